"""Generated model structures for the differential test (tests/test_differential.py): the
shapes real models take beyond "a list of distinct blocks, each called once, returning a
tensor, with fixed trainable parameters and no buffers", each trained by an ordinary DeepSpeed
loop, with and without the "protrain" section.

A structure is a JSON-able dict (so ranks spawned for a two-rank run rebuild it):

- ``input``: "tokens" (integer (batch, seq) ids, next-token labels) or "features" (float
  (batch, features) rows, one class label each: no sequence dimension);
- ``depth``: entries in the block list; ``blocks``: "distinct", "shared" (one block object
  listed ``depth`` times: weights shared across layers) or "alternating" (two objects, a b a b);
- ``calls``: how often the forward calls each entry in a row (ALBERT-style repetition);
- ``output``: what a block returns: "tensor", "inplace" (its input, the residual added in
  place), "tuple" (hidden, aux), "tuple_second" (aux, hidden), "dict" ({"hidden": ...,
  "aux": ...}) or "model_output" (a Hugging Face ModelOutput);
- ``layerdrop``: each block skipped with probability 0.4 in a training forward;
- ``buffers``: BatchNorm in every block and a counter the model bumps in forward;
- ``schedule``: None, "unfreeze" (the embedding and the first block frozen for the first two
  steps, then trainable) or "freeze" (the first block frozen from step 2);
- ``eval_first``: an evaluation forward under ``torch.no_grad()`` (and ``model.eval()``) before
  training.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, FEATURES, CLASSES, HIDDEN, SEQ, BATCH = 64, 12, 10, 16, 8, 4


class Block(nn.Module):
    def __init__(self, output: str, buffers: bool):
        super().__init__()
        self.output = output
        self.fc1 = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = nn.Linear(2 * HIDDEN, HIDDEN)
        self.norm = nn.BatchNorm1d(HIDDEN) if buffers else nn.LayerNorm(HIDDEN)

    def forward(self, x):
        if self.output == "inplace":      # the residual added into the input it returns
            n = self.norm(x.clone().reshape(-1, HIDDEN)).view_as(x)
            return x.add_(self.fc2(F.gelu(self.fc1(n))))
        n = self.norm(x.reshape(-1, HIDDEN)).view_as(x)
        h = x + self.fc2(F.gelu(self.fc1(n)))
        aux = h.detach().pow(2).mean()
        if self.output == "tuple":
            return h, aux
        if self.output == "tuple_second":
            return aux, h
        if self.output == "dict":
            return {"hidden": h, "aux": aux}
        if self.output == "model_output":
            from transformers.modeling_outputs import BaseModelOutput
            return BaseModelOutput(last_hidden_state=h)
        return h


def hidden_of(out, output: str) -> torch.Tensor:
    return {"tensor": lambda: out, "inplace": lambda: out, "tuple": lambda: out[0], "tuple_second": lambda: out[1],
            "dict": lambda: out["hidden"], "model_output": lambda: out.last_hidden_state}[output]()


class Net(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(VOCAB, HIDDEN) if s["input"] == "tokens" else nn.Linear(FEATURES, HIDDEN)
        made = [Block(s["output"], s["buffers"]) for _ in range({"distinct": s["depth"], "shared": 1,
                                                                  "alternating": 2}[s["blocks"]])]
        self.layers = nn.ModuleList([made[i % len(made)] for i in range(s["depth"])])
        self.head = nn.Linear(HIDDEN, VOCAB if s["input"] == "tokens" else CLASSES)
        if s["buffers"]:
            self.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    def forward(self, x, labels):
        h = self.embed(x)
        if self.s["buffers"] and self.training:
            self.forwards += 1
        for block in self.layers:
            if self.s.get("layerdrop") and self.training and float(torch.rand(())) < 0.4:
                continue            # LayerDrop: a block skipped in this step
            for _ in range(self.s["calls"]):
                h = hidden_of(block(h), self.s["output"])
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def batch(s: dict, step: int, rank: int = 0, world: int = 1):
    """This rank's share of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    n = BATCH * world
    if s["input"] == "tokens":
        ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
        x, y = ids[:, :-1], ids[:, 1:]
    else:
        x = torch.randn(n, FEATURES, generator=g)
        y = torch.randint(0, CLASSES, (n,), generator=g)
    return x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]


def _trainable(model: Net, s: dict, step: int) -> None:
    """The schedule's requires_grad flags for ``step``."""
    if s.get("schedule") == "unfreeze":
        frozen = step < 2
        for p in [*model.embed.parameters(), *model.layers[0].parameters()]:
            p.requires_grad_(not frozen)
    elif s.get("schedule") == "freeze" and step == 2:
        for p in model.layers[0].parameters():
            p.requires_grad_(False)


def ds_config(section: dict | None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.5, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    if section is not None:
        cfg["protrain"] = {"enabled": True, "device_memory": "1GiB", "progress": False,
                           "verbosity": 0, **section}
    return cfg


def forced(model: nn.Module) -> dict:
    """Pins that send the model through the offload path: chunks the size of its largest
    parameter, one kept on the device, the first block checkpointed and the second swapped
    (where there are blocks enough)."""
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    return {"chunk_size": largest, "n_persist": 1, "n_checkpoint": 1, "n_swap": 1}


def train(s: dict, section: dict | None, steps: int = 4, rank: int = 0, world: int = 1) -> dict:
    """Train structure ``s`` ``steps`` optimizer steps, with the "protrain" section ``section``
    ("forced": the offload pins above, fewer of them where the structure rules some out - the
    layout keeps a shared block's chunks on the device, a block list planned coarser has no
    blocks to swap - as the refusal names them) or without it (None: plain DeepSpeed); returns
    losses, the evaluation loss, final weights and buffers and the pins that held, or the error
    ProTrain raised."""
    from protrain.search import InfeasibleError
    if section != "forced":
        return _train(s, section, steps, rank, world)
    torch.manual_seed(0)
    pins = forced(Net(s))
    for drop in ((), ("n_swap", "n_checkpoint"), ("n_swap", "n_checkpoint", "n_persist")):
        tried = {k: v for k, v in pins.items() if k not in drop}
        try:
            return dict(_train(s, tried, steps, rank, world, raise_infeasible=True), pins=tried)
        except InfeasibleError as e:
            if not any(f"pinned {k}" in str(e) or f"{k}=" in str(e) for k in tried):
                return {"error": f"InfeasibleError: {e}"}
    return {"error": f"InfeasibleError: {e}"}


def _train(s: dict, section: dict | None, steps: int, rank: int, world: int,
           raise_infeasible: bool = False) -> dict:
    import deepspeed
    from protrain.config import ConfigError
    from protrain.search import InfeasibleError
    torch.manual_seed(0)
    model = Net(s)
    _trainable(model, s, 0)
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(copy.deepcopy(section)))
        out = {"losses": []}
        if s.get("eval_first"):
            engine.eval()
            with torch.no_grad():
                out["eval"] = engine(*batch(s, 99, rank, world)).item()
            engine.train()
        for step in range(steps):
            _trainable(model, s, step)
            loss = engine(*batch(s, step, rank, world))
            engine.backward(loss)
            engine.step()
            out["losses"].append(loss.item())
    except (ConfigError, RuntimeError) as e:
        if section is None or (raise_infeasible and isinstance(e, InfeasibleError)):
            raise
        return {"error": f"{type(e).__name__}: {e}"}
    state = model.state_dict()          # a sync point: the last step's host updates are in
    out["weights"] = {n: state[n].detach().clone() for n, _ in model.named_parameters()}
    out["buffers"] = {n: b.detach().clone() for n, b in model.named_buffers()}
    if hasattr(engine, "destroy"):
        engine.destroy()
    return out


def run_rank(rank: int, world: int, port: int, runs: dict, out_dir: str) -> None:
    """One gloo rank of ``runs`` ({name: (structure, section)}), done in turn; each rank saves
    its results to out_dir/rank{r}.pt."""
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    results = {name: train(s, section, rank=rank, world=world) for name, (s, section) in runs.items()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launch(world: int, runs: dict, out_dir: str) -> list[dict]:
    """Each rank's results of ``runs`` (see run_rank)."""
    import os

    from ranks import start_ranks
    from dpworker import free_port
    os.makedirs(out_dir, exist_ok=True)
    start_ranks(run_rank, (world, free_port(), runs, out_dir), world)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]

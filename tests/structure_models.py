"""Models that are not transformers, for tests/test_model_structures.py: DeepSpeed's unit-test
SimpleModel, an MLP on (batch, features), CNNs on (batch, channels, H, W), a model whose
block list is named in the section; their batches; a training loop that runs in the test's
process or on gloo ranks (``run_rank``)."""
from __future__ import annotations

import copy
import os
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn


class SimpleModel(nn.Module):
    """DeepSpeed's tests/unit/simple_model.py SimpleModel (not installed with DeepSpeed): Linear
    layers in a ModuleList - of one by default, so no list of repeated blocks - and the loss
    returned from forward(x, y). With ``nlayers`` > 1 its loop applies layer i // 2 again at
    step i: a block that runs twice in one forward."""

    def __init__(self, hidden_dim, empty_grad=False, nlayers=1):
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        if empty_grad:
            self.linear2 = nn.Linear(hidden_dim, hidden_dim)
        self.cross_entropy_loss = nn.CrossEntropyLoss()
        self.empty_grad = empty_grad

    def forward(self, x, y):
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for i, layer in enumerate(self.linears):
                x = self.linears[i // 2](x) + layer(x)
        return self.cross_entropy_loss(x, y)


class Residual(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


class MLP(nn.Module):
    """(batch, features) in, class labels (batch,): a list of repeated blocks, no sequence."""

    def __init__(self, d: int = 32, n: int = 4):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.layers = nn.ModuleList([Residual(d) for _ in range(n)])
        self.head = nn.Linear(d, 10)

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.layers:
            h = block(h)
        return F.cross_entropy(self.head(h), y)


class CNN(nn.Module):
    """(batch, 3, 16, 16) images: top-level modules only, a BatchNorm (running statistics a
    forward updates), and pooling between the blocks (code of no block)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x, y):
        h = F.max_pool2d(torch.relu(self.bn(self.conv1(x))), 2)
        h = F.max_pool2d(torch.relu(self.conv2(h)), 2)
        return F.cross_entropy(self.fc(h.flatten(1)), y)


class ReversedCNN(nn.Module):
    """Its modules declared in another order than its forward runs them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16 * 4 * 4, 10)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x, y):
        h = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        h = F.max_pool2d(torch.relu(self.conv2(h)), 2)
        return F.cross_entropy(self.fc(h.flatten(1)), y)


class Gated(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.a(x) * torch.sigmoid(self.b(x))


class Encoder(nn.Module):
    """Blocks of different classes in ``encoder.layer`` (found by no rule: not one class),
    beside a smaller list of two identical modules (``aux``) the finder would take instead."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList([Residual(d), Gated(d), Residual(d), Gated(d)])
        self.aux = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])
        self.head = nn.Linear(d, 10)

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.encoder.layer:
            h = block(h)
        h = h + 0.5 * self.aux[1](self.aux[0](h))
        return F.cross_entropy(self.head(h), y)


class Albert(nn.Module):
    """Hugging Face ALBERT's masked LM, behind a wrapper: one layer group (its default) that
    runs once per layer, so no list of repeated blocks; its embedding tied to the output."""

    def __init__(self):
        super().__init__()
        import transformers
        cfg = transformers.AlbertConfig(
            vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=3,
            num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
        self.model = transformers.AlbertForMaskedLM(cfg)

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


MODELS = {"simple": lambda: SimpleModel(32), "simple_empty_grad": lambda: SimpleModel(32, empty_grad=True),
          "simple_3_layers": lambda: SimpleModel(32, nlayers=3), "mlp": MLP, "cnn": CNN,
          "reversed_cnn": ReversedCNN, "encoder": Encoder, "albert": Albert}


def batch(kind: str, step: int, size: int):
    """The ``step``-th batch of ``size`` samples for a model of ``kind`` (the same on every run)."""
    g = torch.Generator().manual_seed(step)
    if kind == "albert":
        ids = torch.randint(0, 64, (size, 16), generator=g)
        return ids, ids
    if kind.endswith("cnn"):
        return torch.randn(size, 3, 16, 16, generator=g), torch.randint(0, 10, (size,), generator=g)
    if kind.startswith("simple"):
        return torch.randn(size, 32, generator=g), torch.randint(0, 32, (size,), generator=g)
    return torch.randn(size, 16, generator=g), torch.randint(0, 10, (size,), generator=g)


def ds_config(protrain: dict | None, micro_batch: int = 2) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "steps_per_print": 10**6}
    if protrain is not None:
        cfg["protrain"] = {"enabled": True, "device_memory": "1GiB", "progress": False,
                           "verbosity": 0, **copy.deepcopy(protrain)}
    return cfg


def train(kind: str, protrain: dict | None, *, steps: int = 4, sizes=None, rank: int = 0,
          world: int = 1) -> dict:
    """Train a model of ``kind`` under plain DeepSpeed ZeRO-0 (``protrain`` None) or with the
    section; each rank takes its share of every global batch (``sizes[i]`` samples per rank
    at step i, default 2). Returns the losses, the final weights and buffers, and the plan."""
    import deepspeed
    torch.manual_seed(0)
    model = MODELS[kind]()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(protrain))
    sizes = sizes or [2] * steps
    losses = []
    for i, mb in enumerate(sizes):
        x, y = (t[rank * mb:(rank + 1) * mb].to(engine.device) for t in batch(kind, i, mb * world))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = model.state_dict()     # waits for the last step's CPU Adam
    out = {"losses": losses,
           "weights": {n: state[n].detach().clone() for n, _ in model.named_parameters()},
           "buffers": {n: b.detach().clone() for n, b in model.named_buffers()}}
    plan = getattr(engine, "protrain_plan", None)
    if plan is not None:
        rt = engine.protrain_runtime
        out.update(blocks=list(plan.blocks), modes="".join(m.letter for m in plan.block_modes),
                   offloaded=len(rt.chunks.offloaded()), notes=list(plan.notes),
                   micro_batch=plan.micro_batch, seq_len=plan.seq_len)
    engine.destroy()
    return out


def run_rank(rank: int, world: int, port: int, runs: dict, out_dir: str) -> None:
    """One gloo rank: the ``runs`` ({name: (kind, protrain section)}) in turn; rank 0 saves
    each run's result to out_dir/name.pt."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    sys.path.insert(0, os.path.dirname(__file__))
    from dpworker import leave
    for name, (kind, section) in runs.items():
        result = train(kind, section, rank=rank, world=world)
        if rank == 0:
            torch.save(result, os.path.join(out_dir, f"{name}.pt"))
    leave(types.SimpleNamespace())      # the engines are destroyed: no group attributes left

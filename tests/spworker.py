"""One rank of sequence-parallel test runs: an ordinary DeepSpeed training loop (the script
does not know about sequence parallelism) on a tiny Hugging Face Llama built from a config, or
the built-in GPT. Spawned with torch.multiprocessing, gloo on CPU; one launch runs several
trainings one after another.

Each rank takes its contiguous share of every global batch, as a DistributedSampler would;
with ``gas`` > 1 a rank's share is split into that many micro-batches. The gradients each
optimizer step applies are recorded (what Adam receives, per parameter piece) so a test can
compare them across launches."""
from __future__ import annotations

import json
import os
import sys


def llama(spec):
    from transformers import LlamaConfig, LlamaForCausalLM
    m = spec["model"]
    cfg = LlamaConfig(vocab_size=m.get("vocab", 128), hidden_size=m.get("hidden", 64),
                      intermediate_size=m.get("ffn", 128), num_hidden_layers=m.get("layers", 2),
                      num_attention_heads=m.get("heads", 4), num_key_value_heads=m.get("kv_heads", 4),
                      max_position_embeddings=max(256, spec["seq"]),
                      attn_implementation=m.get("attn", "sdpa"))
    return LlamaForCausalLM(cfg)


def samples(spec, step: int):
    """The global batch of a step: token ids and labels with some -100 (a different number
    per sample, so shards hold different counts of valid targets)."""
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    n, s = spec["global_batch"], spec["seq"]
    ids = torch.randint(0, spec["model"].get("vocab", 128), (n, s), generator=g)
    labels = ids.clone()
    for i in range(n):
        k = int(torch.randint(0, s // 2, (1,), generator=g))
        start = int(torch.randint(0, s - k, (1,), generator=g))
        labels[i, start:start + k] = -100
    return ids, labels


def run_rank(rank: int, world: int, port: int, runs: list[dict], out_dir: str) -> None:
    """Run each spec of ``runs`` in turn in this process (imports and process start-up cost
    more than these tiny trainings)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    sys.path.insert(0, os.path.dirname(__file__))
    recorder = UpdateRecorder()
    _count_host_waits()

    results = {}
    for spec in runs:
        try:
            if spec.get("exchange"):
                results[spec["name"]] = _exchange(rank, world)
                continue
            if spec.get("trainer"):
                import sptrainer
                results[spec["name"]] = sptrainer.train(rank, world, spec, out_dir, recorder)
                continue
            results[spec["name"]] = _train(rank, world, spec, recorder, out_dir)
        except Exception as e:  # noqa: BLE001 - reported to the test, which names the run
            results[spec["name"]] = {"error": f"{type(e).__name__}: {e}"}
            if not spec.get("expect_error"):
                raise
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class UpdateRecorder:
    """Records the gradients each optimizer step applies (what Adam receives, per parameter
    piece: ``(name, lo, hi, values)``) into the list of the engine that applied them.

    ``start()`` gives the list for the engine built next; the engine adopts it at its first
    runtime (and keeps it across re-plans), and only its runtimes' optimizers record into it.
    Other chunk optimizers running in the process record nothing: the hardware probe's (its
    update-overhead measure steps a ChunkOptimizer of its own, parameters ``p0``, ``p1``, ...,
    during the first forward of an engine) and an earlier engine's."""

    def __init__(self):
        from protrain.runtime.optimizer import ChunkOptimizer
        from protrain_ds.engine import ProTrainEngine
        self.current: list = []
        update, build = ChunkOptimizer._update, ProTrainEngine._protrain_build_runtime

        def recording(opt, c, g, kernel, coef, *args, **kwargs):
            steps = getattr(opt, "recorded_grads", None)
            if steps is not None:
                lo = 0 if c.persistent else c.shard_lo
                hi = c.numel if c.persistent else c.shard_hi
                for s in c.slots:
                    a, b = max(s.offset, lo), min(s.stop, hi)
                    if a < b:
                        steps[-1].append((s.name, a - s.offset, b - s.offset,
                                          g[a - lo:b - lo].float().tolist()))
            return update(opt, c, g, kernel, coef, *args, **kwargs)

        def building(engine, *args, **kwargs):
            build(engine, *args, **kwargs)
            if not hasattr(engine, "recorded_grads"):
                engine.recorded_grads = self.current
            engine.protrain_runtime.optimizer.recorded_grads = engine.recorded_grads
            engine.protrain_runtime.streams.count_host_reads = True    # HOST_WAITS
        ChunkOptimizer._update = recording
        ProTrainEngine._protrain_build_runtime = building

    def start(self) -> list:
        """A new list of steps for the engine built next (each step: a list of pieces)."""
        self.current = []
        return self.current


HOST_WAITS = {"to_host": 0, "all_gather_object": 0}
"""Host reads of device data (Streams.to_host of an engine's runtime: not the hardware probe's,
which measures with streams of its own during an engine's first forward when the probe is not
cached) and layouts gathered as objects, counted from the first training forward of a run to
the end of its loop."""


def _count_host_waits() -> None:
    import torch.distributed as dist
    from protrain.runtime.streams import Streams
    to_host, gather_object = Streams.to_host, dist.all_gather_object

    def reading(self, t):
        if getattr(self, "count_host_reads", False):
            HOST_WAITS["to_host"] += 1
        return to_host(self, t)

    def gathering(*a, **k):
        HOST_WAITS["all_gather_object"] += 1
        return gather_object(*a, **k)
    Streams.to_host = reading
    dist.all_gather_object = gathering


def _exchange_batch(step: int, rank: int):
    """What rank ``rank`` passes to forward at call ``step`` of ``_exchange``: the same layout
    on every rank for calls 0 and 1, then rank 1 alone changes it (a longer sequence, more
    keywords: a bool mask, a bf16 0-d tensor, a nested list), then back."""
    import torch
    ids = torch.arange(6).view(2, 3) + 10 * step + 100 * rank
    kwargs = {"labels": torch.full((2, 3), rank), "use_cache": False}
    if step == 2 and rank == 1:
        ids = torch.arange(10).view(2, 5) + 7
        kwargs.update(mask=torch.ones(2, 5, dtype=torch.bool), w=torch.tensor(1.5, dtype=torch.bfloat16),
                      extra=[torch.tensor([3.0, 4.0]), "text"])
    return (ids,), kwargs


def _exchange(rank: int, world: int) -> dict:
    """protrain.sp.batch.BatchExchange over the whole world: every rank gets every rank's
    batch, equal to what that rank passed, across layout changes; layouts travel as objects
    only when one changed."""
    import torch
    import torch.distributed as dist
    from protrain.sp.batch import BatchExchange
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    ex = BatchExchange(dist.group.WORLD, dist.group.WORLD, world, torch.device("cpu"))

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if type(a) in (tuple, list):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if type(a) is dict:
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b
    exchanges, right = [], []
    for step in range(4):
        got = ex(*_exchange_batch(step if step < 3 else 0, rank))
        exchanges.append(ex.layout_exchanges)
        right.append(all(same(got[q], _exchange_batch(step if step < 3 else 0, q)) for q in range(world)))
    return {"exchanges": exchanges, "right": right}


def budget_between(spec, world: int, degrees=(1, 2)) -> int:
    """A device budget at which the leanest plan with P = degrees[1] fits and with degrees[0]
    does not (from this model's measured profiles, as the engine will take them)."""
    import math

    import torch
    from protrain.config import KnobPins, PlannerConfig
    from protrain.profile.hardware import HardwareProfile
    from protrain.measure.profiler import profile_model
    from protrain.search import InfeasibleError
    from protrain.sp.planner import search_sequence_parallel
    torch.manual_seed(0)
    model = llama(spec)
    ids, labels = samples(spec, spec.get("start", 0))
    mb = spec["global_batch"] // world // spec.get("gas", 1)
    profiles = []
    for s in (spec["seq"], spec["seq"] // 2):
        x, y = ids[:mb, :s], labels[:mb, :s]
        profiles.append(profile_model(model, lambda m: m(input_ids=x, labels=y, use_cache=False).loss,
                                      progress=False, micro_batch=mb, seq_len=s))
    hw = HardwareProfile(name="budget", source="measured", device_type="cpu", device_memory=2**40,
                         host_memory=2**40, h2d_bandwidth=1e10, d2h_bandwidth=1e10,
                         gpu_adam_rate=1e9, cpu_adam_rate=1e9, collective_bandwidth=1e10,
                         alltoall_bandwidth=1e10)
    need = []
    for p in degrees:
        cfg = PlannerConfig(device_memory=1, data_parallel_size=world,
                            grad_accumulation_steps=spec.get("gas", 1), pins=KnobPins(sequence_parallel=p))
        try:
            search_sequence_parallel(profiles[0], hw, cfg, seq_len=spec["seq"], second=profiles[1])
        except InfeasibleError as e:
            need.append(e.device_needed)
    assert need[1] < need[0], need
    return int(math.sqrt(need[0] * need[1]))


def _train(rank, world, spec, recorder, out_dir) -> dict:
    import torch
    import deepspeed
    gas = spec.get("gas", 1)
    share = spec["global_batch"] // world
    mb = share // gas
    if spec.get("budget_between"):
        spec = dict(spec, protrain=dict(spec["protrain"], device_memory=budget_between(
            spec, world, tuple(spec["budget_between"]))))
    ds = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
          "steps_per_print": 10**6, **spec.get("extra", {})}
    if spec.get("protrain") is not None:
        ds["protrain"] = {"enabled": True, "device_memory": "4GiB", "progress": False,
                          "verbosity": spec.get("verbosity", 0), **spec["protrain"]}
    torch.manual_seed(0)
    if spec["model"]["kind"] == "llama":
        model = llama(spec)
    else:
        from protrain.models import GPT, GPTConfig
        model = GPT(GPTConfig(**{k: v for k, v in spec["model"].items() if k != "kind"}))
    grads = recorder.start()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    if spec.get("load"):
        path, _ = engine.load_checkpoint(spec["load"])
        assert path is not None, path
    losses = []
    start = spec.get("start", 0)
    HOST_WAITS.update(to_host=0, all_gather_object=0)
    for step in range(start, start + spec["steps"]):
        ids, labels = samples(spec, step)
        # The last step's host updates (CPU Adam may run into the next forward) are recorded
        # into their own step: wait for them before the next one begins.
        if getattr(engine, "protrain_sync", None) is not None:
            engine.protrain_sync()
        grads.append([])
        for micro in range(gas):
            lo = rank * share + micro * mb
            x, y = ids[lo:lo + mb], labels[lo:lo + mb]
            if spec["model"]["kind"] == "llama":
                extra = {}
                if spec.get("num_items"):   # the Trainer's loss: a sum over the global batch's count
                    extra["num_items_in_batch"] = (labels[:, 1:] != -100).sum()
                if spec.get("loss_outside"):   # the script computes the loss from the logits
                    logits = engine(input_ids=x).logits
                    loss = torch.nn.functional.cross_entropy(
                        logits[:, :-1].flatten(0, 1).float(), y[:, 1:].flatten(), ignore_index=-100)
                else:
                    out = engine(input_ids=x, labels=y, **extra)
                    loss = out.loss
            else:   # the built-in GPT takes next-token targets
                loss = engine(x, torch.where(y == -100, y, torch.roll(x, -1, 1)))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    waits = dict(HOST_WAITS)
    if getattr(engine, "protrain_sync", None) is not None:
        engine.protrain_sync()
    if spec.get("save"):
        engine.save_checkpoint(spec["save"])
    result = {"losses": losses, "grads": [list(g) for g in grads], "host_waits": waits}
    if spec.get("eval"):        # evaluation forwards (no gradient) on step 0's micro-batches
        engine.eval()
        ids, labels = samples(spec, 0)
        with torch.no_grad():
            result["eval"] = [engine(input_ids=ids[lo:lo + mb], labels=labels[lo:lo + mb]).loss.item()
                              for lo in range(rank * share, (rank + 1) * share, mb)]
            # The model called directly (generate's way): each rank its whole sequences.
            result["outside"] = [model(input_ids=ids[lo:lo + mb], labels=labels[lo:lo + mb]).loss.item()
                                 for lo in range(rank * share, (rank + 1) * share, mb)]
        engine.train()
    plan = getattr(engine, "protrain_plan", None)
    if plan is not None:
        rt = engine.protrain_runtime
        result.update(sp=plan.knobs.sequence_parallel, modes="".join(m.letter for m in plan.block_modes),
                      knobs=list(plan.knobs.as_tuple()), notes=list(plan.notes),
                      offloaded=len(rt.chunks.offloaded()), explain=plan.explain(),
                      head_tile=plan.knobs.head_tile, mlp_tile=plan.knobs.mlp_tile,
                      tiled_forwards=rt.head_tiling.forwards if rt.head_tiling is not None else 0)
        if rt.accounting is not None:
            result.update(activation_peak=rt.accounting.activation_peak,
                          predicted_activation_peak=plan.prediction.activation_peak_bytes,
                          peak=rt.device_peak(), predicted_peak=plan.prediction.peak_device_bytes,
                          budget=plan.device_memory)
    engine.destroy()
    if rank == 0:
        torch.save({n: p.detach().float().clone() for n, p in model.named_parameters()},
                   os.path.join(out_dir, f"weights-{spec['name']}.pt"))
    return result


def launch(world: int, runs: list[dict], out_dir: str) -> dict[str, list[dict]]:
    """Run ``runs`` on ``world`` ranks; returns {run name: [result of each rank]}."""
    from ranks import start_ranks
    from dpworker import free_port
    os.makedirs(out_dir, exist_ok=True)
    start_ranks(run_rank, (world, free_port(), runs, out_dir), world)
    per_rank = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]
    return {spec["name"]: [r[spec["name"]] for r in per_rank] for spec in runs}


def full_grads(ranks: list[dict]) -> list[dict]:
    """Per optimizer step, every parameter's flat gradient assembled from all ranks' pieces."""
    import torch
    steps = []
    for i in range(len(ranks[0]["grads"])):
        pieces = {}
        for r in ranks:
            for name, lo, hi, vals in r["grads"][i]:
                pieces.setdefault(name, []).append((lo, hi, vals))
        out = {}
        for name, ps in pieces.items():
            n = max(hi for _, hi, _ in ps)
            t = torch.full((n,), float("nan"))
            for lo, hi, vals in ps:
                t[lo:hi] = torch.tensor(vals)
            out[name] = t
        steps.append(out)
    return steps

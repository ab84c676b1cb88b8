"""One rank of a data-parallel test run (spawned with torch.multiprocessing, gloo on CPU)."""
from __future__ import annotations

import json
import os
import sys


def run_rank(rank: int, world: int, port: int, spec: dict, out_dir: str) -> None:
    """One rank: ``spec["runs"]`` are training runs {name: spec}, done in turn in the same
    processes (each writes into out_dir/name): the start-up is paid once."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    sys.path.insert(0, os.path.dirname(__file__))
    runs = spec["runs"]
    engine = None
    for name, one in runs.items():
        out = os.path.join(out_dir, name)
        os.makedirs(out, exist_ok=True)
        if one.get("saves"):
            import saveworker
            result, engine = saveworker.run(rank, world, one, out)
        elif one.get("expect_error"):         # a refusal every rank must raise: its words
            try:
                result, engine = train_run(rank, world, one, out)
            except Exception as e:  # noqa: BLE001 - reported to the test
                result, engine = {"error": f"{type(e).__name__}: {e}"}, None
        else:
            result, engine = train_run(rank, world, one, out)
        if name == list(runs)[-1]:
            result["process_groups_left"] = leave(engine)
        del engine
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


def train_run(rank: int, world: int, spec: dict, out_dir: str):
    """Train as ``spec`` says; (what the test reads, the destroyed engine)."""
    import torch
    import deepspeed
    import protrain.runtime.runtime as rt_mod
    from protrain.models import GPTConfig, synthetic_batch
    from protrain.runtime.streams import Streams

    if spec.get("deferred_streams"):       # copies as late as CUDA may run them
        from deferred_streams import DeferredStreams
        rt_mod.Streams = DeferredStreams
    else:
        rt_mod.Streams = Streams
    import protrain.runtime.collectives as coll_mod
    # A device backend (NCCL) as far as collectives.host_side can tell: host messages then go
    # over a gloo group of their own, as on GPUs.
    coll_mod.dist = _AsIfNCCL() if spec.get("device_backend") else torch.distributed
    if spec.get("threads"):             # compute threads of this rank (default: torch's)
        torch.set_num_threads(spec["threads"])
    cfg = GPTConfig(**spec["model"])
    global_batch = spec["global_batch"]
    mb = global_batch // world
    ds = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
          "steps_per_print": 10**6, **spec.get("extra", {})}
    if spec.get("protrain") is not None:
        ds["protrain"] = {"enabled": True, "device_memory": "1GiB", "progress": False,
                          "verbosity": 0, **spec["protrain"]}
        if spec.get("budget_between"):
            ds["protrain"]["device_memory"] = budget_between(cfg, mb, world, spec["protrain"],
                                                             *spec["budget_between"])
    factor = spec.get("loss_factor", 1.0)
    torch.manual_seed(0)
    model = _model(spec.get("kind", "gpt"), cfg)
    set_trainable(model, spec.get("frozen", ()), False)
    # "trainable": the optimizer holds the parameters trainable now (the Hugging Face Trainer's way)
    held = [p for p in model.parameters() if p.requires_grad] if spec.get("optimizer_over") == "trainable" \
        else model.parameters()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=held, config=ds)
    if spec.get("load"):
        path, client = engine.load_checkpoint(spec["load"])
        assert path is not None and client == {"note": "resume me"}, (path, client)
    start = spec.get("start", 0)
    losses, norms = [], []     # norms: ProTrain's global gradient norm at each boundary
    plans, peaks = [], []      # per micro-batch: the plan in force, (device peak, its bound)
    for i in range(start, start + spec["steps"]):
        # [(micro-batch, prefixes, flag[, the one rank that does it])]
        for at, prefixes, flag, *only in spec.get("requires_grad", ()):
            if at == i and (not only or only[0] == rank):
                set_trainable(model, prefixes, flag)
        x, y = synthetic_batch(cfg, global_batch, seed=i)
        x, y = x[rank * mb:(rank + 1) * mb], y[rank * mb:(rank + 1) * mb]
        if spec.get("batches"):                # (micro-batch, tokens) of each rank's batch
            m, s = spec["batches"][i - start][rank]
            x, y = x[:m, :s].contiguous(), y[:m, :s].contiguous()
        if spec.get("kind") == "branch":        # taken every other optimizer step
            model.branch = i // engine.gradient_accumulation_steps() % 2 == 0
        loss = engine(x, y)
        engine.backward(loss * factor if factor != 1.0 else loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        losses.append(loss.item())
        rt = getattr(engine, "protrain_runtime", None)
        if rt is not None and boundary:
            norms.append(rt.optimizer.global_grad_norm)
        if rt is not None:
            plan = engine.protrain_plan
            plans.append([plan.seq_len, plan.knobs.sequence_parallel] + list(plan.knobs.as_tuple())
                         + [plan.knobs.n_shard])
            if rt.accounting is not None:
                peaks.append([rt.device_peak(), plan.prediction.peak_device_bytes * (1 + plan.memory_margin)])
        if spec.get("save") and spec.get("save_at") == i + 1:     # mid-run, then go on
            engine.save_checkpoint(spec["save"], client_state={"note": "resume me"})
    if spec.get("save") and spec.get("save_at") is None:
        engine.save_checkpoint(spec["save"], client_state={"note": "resume me"})
    if spec.get("save_16bit"):                      # every rank calls it (ZeRO-3's contract)
        engine.save_16bit_model(os.path.join(out_dir, "16bit"), "model.bin")
    result = {"losses": losses, "norms": norms, "global_steps": engine.global_steps, "lr": engine.get_lr(),
              "plans": plans, "peaks": peaks,
              "host_group": getattr(getattr(engine, "_protrain_host", None), "group", None) is not None}
    rt = getattr(engine, "protrain_runtime", None)
    if rt is not None:
        result["host_bytes"] = rt.chunks.host_bytes()
        result["plan"] = list(engine.protrain_plan.knobs.as_tuple())
        result["n_nvme"] = engine.protrain_plan.knobs.n_nvme
        result["offloaded"] = len(rt.chunks.offloaded())
        result["sharded"] = len(rt.chunks.sharded())
        result["device_state_bytes"] = rt.chunks.device_bytes()
        result["planned_state_bytes"] = engine.protrain_plan.prediction.model_state_bytes
        result["most_pending_copies"] = getattr(rt.streams, "most_pending", None)
        result["races"] = getattr(rt.streams, "races", None)
        st = rt.optimizer.stats
        result["overlapped_chunks"], result["rollbacks"] = st.overlapped_chunks, st.rollbacks
        result["reductions_overlapped"] = st.reductions_overlapped
        kernel = rt.optimizer.host_kernel
        result["host"] = {"ranks_per_node": engine._protrain_node.ranks_per_node,
                          "plan_ranks_per_node": engine.protrain_plan.ranks_per_node,
                          "kernel_threads": getattr(kernel, "threads", None),
                          "node_cores": engine._protrain_node.cores}
    engine.destroy()                      # gathers sharded parameters back on every rank
    if rank == 0:
        torch.save({n: p.detach().float().clone() for n, p in model.named_parameters()},
                   os.path.join(out_dir, "weights.pt"))
    return result, engine


def set_trainable(model, prefixes, flag: bool) -> None:
    """requires_grad = ``flag`` on the parameters whose names start with one of ``prefixes``."""
    for n, p in model.named_parameters():
        if any(n.startswith(x) for x in prefixes):
            p.requires_grad_(flag)


class _AsIfNCCL:
    """torch.distributed, with a default backend that is not gloo."""

    def __getattr__(self, name):
        import torch.distributed
        return getattr(torch.distributed, name)

    @staticmethod
    def get_backend(group=None) -> str:
        return "nccl"


def budget_between(cfg, mb: int, world: int, pins: dict, short: int, long: int) -> int:
    """A device budget at which the plan with every chunk on the device (and ``pins``) fits
    batches of ``short`` tokens and not of ``long``, and a plan that offloads chunks fits
    ``long`` (from this model's profile at ``short``, scaled as the engine scales it): a
    re-plan for ``long`` must offload chunks."""
    import math
    from dataclasses import replace

    import torch
    from protrain.config import PlannerConfig
    from protrain.models import GPT, synthetic_batch
    from protrain.profile.hardware import HardwareProfile
    from protrain.measure.profiler import profile_model
    from protrain.search import InfeasibleError, search
    from protrain.sp import scale_profile
    from protrain_ds.config import ProTrainDSConfig
    torch.manual_seed(0)
    x, y = synthetic_batch(cfg, mb, short)
    profile = profile_model(GPT(cfg), lambda m: m(x, y), progress=False, micro_batch=mb, seq_len=short)
    hw = HardwareProfile(name="budget", source="measured", device_type="cpu", device_memory=2**40,
                         host_memory=2**40, h2d_bandwidth=1e10, d2h_bandwidth=1e10,
                         gpu_adam_rate=1e9, cpu_adam_rate=1e9, collective_bandwidth=1e10)
    pins = ProTrainDSConfig.from_ds_config({"protrain": {"enabled": True, **pins}}).planner.pins
    resident = PlannerConfig(device_memory=2**40, data_parallel_size=world, pins=replace(pins, n_persist="all"))
    need = []
    for p in (profile, scale_profile(profile, seq_len=long)):
        plan = search(p, hw, resident)
        need.append(plan.prediction.peak_device_bytes * (1 + plan.memory_margin))
    budget = int(math.sqrt(need[0] * need[1]))
    try:
        search(scale_profile(profile, seq_len=long), hw, replace(resident, device_memory=1, pins=pins))
    except InfeasibleError as e:
        assert e.device_needed < budget < need[1], (e.device_needed, budget, need)
    return budget


def _model(kind: str, cfg):
    """The model a run trains: the built-in GPT, or one of tests/sparse_models.py's."""
    from protrain.models import GPT
    if kind == "gpt":
        return GPT(cfg)
    import sparse_models
    return {"branch": sparse_models.BranchGPT, "moe": sparse_models.MoEGPT}[kind](cfg)


def leave(engine) -> list[str]:
    """Tear the process group down while the interpreter is fully alive; returns the DeepSpeed
    globals still holding a process group afterwards (none, or the abort below can come back).

    torch.distributed.destroy_process_group() alone leaves DeepSpeed's own references
    (deepspeed.utils.groups._WORLD_GROUP, and the engine's group attributes): the gloo
    ProcessGroup then survives into interpreter shutdown, where its worker threads may still
    drop the last reference to a tensor of the last collective; that needs the GIL, Python
    ends the thread inside a noexcept frame, and the rank aborts with "terminate called
    without an active exception" (once in about ten 2-rank runs). DeepSpeed's
    destroy_process_group releases its references; the engine's go with the engine."""
    import gc

    import deepspeed.comm as ds_comm
    import torch.distributed as dist
    from deepspeed.utils import groups
    if not dist.is_initialized():
        return []
    dist.barrier()                        # leave together: rank 0 hosts the rendezvous store
    held = vars(engine).items() if engine is not None else ()     # None: the run was refused
    for name in [n for n, v in held if isinstance(v, dist.ProcessGroup)]:
        setattr(engine, name, None)
    ds_comm.destroy_process_group()
    gc.collect()                          # cycles holding a group go now, not at shutdown
    return [n for n, v in vars(groups).items() if isinstance(v, dist.ProcessGroup)
            or (isinstance(v, dict) and any(isinstance(x, dist.ProcessGroup) for x in v.values()))]


def free_port() -> int:
    """A port nobody listens on now (a fixed one may still be held by an earlier run's store)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(world: int, spec: dict, out_dir: str) -> list[dict]:
    """Each rank's result of one run."""
    return launch_runs(world, {"": spec}, out_dir)[""]


def launch_runs(world: int, runs: dict[str, dict], out_dir: str) -> dict[str, list[dict]]:
    """Several runs in turn in one launch: {name: each rank's result}; weights in out_dir/name."""
    from ranks import start_ranks
    start_ranks(run_rank, (world, free_port(), {"runs": runs}, out_dir), world)
    return {name: [json.load(open(os.path.join(out_dir, name, f"rank{r}.json"))) for r in range(world)]
            for name in runs}

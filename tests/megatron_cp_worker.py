"""One rank of a 2-rank megatron-core GPT on CPU (gloo) with context parallelism, for
tests/test_megatron_cp.py.

1. CP=1 reference: both ranks run the whole batch (Megatron's parallel state with CP=1).
2. The planner chooses CP from Megatron-LM-style arguments (the function the wrapped
   parse_args calls) at a device budget just below what CP=1 needs; ranks whose choices
   differ are stopped before Megatron builds its groups.
3. CP=2: Megatron's parallel state rebuilt with the chosen CP, the same model built from the
   local layer spec inside ``swap_core_attention`` (Megatron's DotProductAttention refuses CP;
   ProTrain's all-to-all attention takes its place), the batch split as Megatron-LM splits it
   (get_batch_on_this_cp_rank: chunks r and 2 CP - 1 - r), the loss the token-weighted sum
   over the CP group, gradients summed over it (what Megatron's DDP does over dp x cp).
4. The same with each activation plan the test pins (e.g. the selective mode) applied.
Loss and every gradient are written out for the test to compare with the reference.

Before all of them, as at Megatron-LM's argument parsing (no process group yet), both ranks
probe the machine at once (``parse_time_hardware``): one measures, the other waits on the
probe's lock and reads its figures."""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))

SEQ, B, VOCAB, LAYERS, HIDDEN, HEADS = 64, 2, 128, 4, 128, 4


class _Patch:
    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def _full_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, SEQ), generator=g)
    return {"input_ids": ids, "position_ids": torch.arange(SEQ).unsqueeze(0).expand(B, -1).contiguous(),
            "labels": torch.randint(0, VOCAB, (B, SEQ), generator=g)}


def _loss(model, batch):
    # Token losses [b, s_local]: the loss is their sum over every token of the sequence divided
    # by the token count (Megatron-LM's loss_func sums numerator and count over the CP group).
    tokens = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"])
    return tokens.float().sum() / (B * SEQ)


class _AllToAlls(TorchDispatchMode):
    """Counts the all-to-alls issued while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _run(model, batch, group=None, result=None, key=None):
    """Loss and gradients (summed over ``group``); ``result[key]``: the all-to-alls backward
    issued (autograd's for the gradients, and any a recompute re-issues)."""
    torch.manual_seed(5)
    model.zero_grad(set_to_none=True)
    loss = _loss(model, batch)
    with _AllToAlls() as counted:
        loss.backward()
    if result is not None:
        result[key] = counted.count
    loss = loss.detach().clone()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if group is not None:
        dist.all_reduce(loss, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
    return float(loss), {n: g.tolist() for n, g in grads.items()}


def _probe_at_parsing(rank: int, world: int, out_dir: str) -> dict:
    """``parse_time_hardware`` on both ranks at once (a file rendezvous first; the probe made
    small, and slow enough that the other rank is waiting before it ends): when this rank's
    call started and ended, what it got; a line in measured.log per measurement."""
    import time
    from pathlib import Path

    from protrain.measure import probe
    from protrain_megatron.context_parallel import parse_time_hardware
    out = Path(out_dir)
    os.environ["PROTRAIN_CACHE"] = str(out / "probe-cache")
    real = probe._measure_rates

    def measure(device, size_mib, adam_params, progress, threads, rank_threads):
        start = time.time()
        hw = real(device, 8, 2**18, progress, threads, rank_threads)
        time.sleep(0.5)
        with open(out / "measured.log", "a") as f:
            f.write(json.dumps({"rank": rank, "start": start, "end": time.time()}) + "\n")
        return hw
    probe._measure_rates = measure
    (out / f"arrived{rank}").touch()
    deadline = time.time() + 120
    while not all((out / f"arrived{r}").exists() for r in range(world)):
        if time.time() > deadline:
            raise TimeoutError("the other rank did not start")
        time.sleep(0.01)
    start = time.time()
    hw = parse_time_hardware()
    probe._measure_rates = real
    return {"start": start, "end": time.time(), "hw": hw.to_dict()}


def main(rank: int, world: int, port: str, out_dir: str, config: str) -> None:
    cfg = json.loads(config)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))   # as a launcher sets it (not inherited from the test process)
    probed = _probe_at_parsing(rank, world, out_dir)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank
    from megatron_cpu import cpu_rng_states, gpt

    from protrain.profile.hardware import HardwareProfile
    from protrain.search import InfeasibleError
    from protrain_megatron import plan_activations
    from protrain_megatron.arguments import MegatronOptions
    from protrain_megatron.context_parallel import choose_context_parallel
    from protrain_megatron.sdpa_attention import swap_core_attention
    cpu_rng_states(_Patch())
    kv = cfg.get("kv_heads")
    hw = HardwareProfile(name="cpu-test", source="measured", device_type="cpu", device_memory=2**30,
                         host_memory=2**30, h2d_bandwidth=1e9, d2h_bandwidth=1e9, gpu_adam_rate=1e9,
                         cpu_adam_rate=1e8, collective_bandwidth=1e9)
    result = {"rank": rank, "probe": probed}

    # 1. CP=1 reference (dropout off: CP splits attention's heads, so its dropout mask differs).
    ps.initialize_model_parallel(1, 1)
    model = gpt(num_layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab=VOCAB, seq=SEQ, dropout=0.0,
                kv_heads=kv)
    result["ref"] = _run(model, _full_batch())
    ps.destroy_model_parallel()

    # 2. The planner's CP at the test's device budget.
    args = SimpleNamespace(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                           num_query_groups=kv, group_query_attention=kv is not None,
                           seq_length=SEQ, micro_batch_size=B, global_batch_size=None,
                           tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                           context_parallel_size=1, vocab_size=VOCAB, padded_vocab_size=None,
                           transformer_impl="local", bf16=False, fp16=False,
                           use_distributed_optimizer=False, max_position_embeddings=SEQ)
    # The budget: just below what CP=1 needs at its leanest (the planner's own figure).
    need = {}
    for p in (1, 2):
        try:
            choose_context_parallel(SimpleNamespace(**{**vars(args), "context_parallel_size": p}),
                                    MegatronOptions(device_memory=2**20), world=world, pinned=True,
                                    hardware=hw)
        except InfeasibleError as e:
            need[p] = e.device_needed
    result["needs"] = need
    choice = choose_context_parallel(args, MegatronOptions(device_memory=need[1] - 1),
                                     world=world, pinned=False, hardware=hw)
    result["chosen"] = choice.degree
    result["reasons"] = list(choice.reasons)
    # Ranks that chose differently stop before Megatron builds groups from their choices (here
    # rank r "chose" r + 1); ranks that agree go on (step 3 goes through the same check).
    from protrain_megatron.context_parallel import agree_before_groups
    agree_before_groups()
    try:
        ps.initialize_model_parallel(1, 1, context_parallel_size=rank + 1)
        result["disagreement"] = None
    except SystemExit as e:
        result["disagreement"] = str(e)

    # 3. CP as chosen, the model built from the local spec with the attention swapped in.
    cp = choice.degree
    ps.initialize_model_parallel(1, 1, context_parallel_size=cp)
    with swap_core_attention(cp > 1):
        model = gpt(num_layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab=VOCAB, seq=SEQ, dropout=0.0,
                    cp=cp, local_attention=True, kv_heads=kv)
    result["attention"] = type(model.decoder.layers[0].self_attention.core_attention).__name__
    group = ps.get_context_parallel_group()
    # megatron-core 0.19 added ``is_hybrid_cp`` and no longer falls back to the CP group
    # without ``cp_group`` (it splits over the whole world): name both where they exist.
    import inspect
    split = inspect.signature(get_batch_on_this_cp_rank).parameters
    extra = {"is_hybrid_cp": False} if "is_hybrid_cp" in split else {}
    if "cp_group" in split:
        extra["cp_group"] = group
    local = get_batch_on_this_cp_rank(_full_batch(), **extra)
    result["cp"] = _run(model, local, group, result, "a2a_backward")

    # 4. With each activation plan in turn (every CP rank profiles, the group's first rank
    # decides).
    result["plans"] = []
    for pins in cfg.get("plans", []):
        applied = plan_activations(model, lambda m: _loss(m, local), hardware=hw, pins=pins,
                                   prefer_native=False, progress=False, verbose=False)
        planned = {"modes": "".join(m.letter for m in applied.plan.block_modes)}
        planned["run"] = _run(model, local, group, planned, "a2a_backward")
        applied.close()
        result["plans"].append(planned)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])

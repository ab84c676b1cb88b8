"""How well ProTrain predicts a megatron-core GPT under its per-layer plans.

Builds a megatron-core GPTModel (local spec, SDPA core attention, learned positions), profiles
it once, then for several pinned plans (keep all; all recomputed through Megatron's own
config; half recomputed through ProTrain's hooks; all swapped; a mix) applies the plan and
measures forward + backward: the activation peak and the median wall time over the timed
iterations, next to the plan's predictions. The activation peak is measured with two meters:
the policy's own storage counter (CPU; the meter the profile was taken with) and the allocator
(max_memory_allocated above the level before the step on CUDA; glibc's bytes in use, mallinfo2
after every op, on CPU), which also sees allocator rounding and autograd's own bookkeeping.

    python bench/megatron_accuracy.py                                       # CPU, small model
    python bench/megatron_accuracy.py --layers 24 --hidden 2048 --heads 16 --seq 2048 --micro-batch 2   # GPU

Writes bench/results/megatron_accuracy-<device>.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from free_port import free_port  # noqa: E402 - bench/ is on the path of its scripts

PLANS = {
    "keep": ({"n_checkpoint": 0, "n_swap": 0}, True),
    "ckpt-all-native": (lambda n: {"n_checkpoint": n, "n_swap": 0}, True),
    "ckpt-half-hooks": (lambda n: {"n_checkpoint": n // 2, "n_swap": 0}, False),
    "swap-all": (lambda n: {"n_checkpoint": 0, "n_swap": n}, True),
    "mixed": (lambda n: {"n_checkpoint": n // 3, "n_swap": n // 3}, True),
}


def build(a, device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from protrain_megatron.sdpa_attention import SDPACoreAttention
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                            use_cpu_initialization=True, add_bias_linear=False, hidden_dropout=0.0,
                            attention_dropout=0.0, bf16=device.type == "cuda",
                            params_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=a.vocab, max_sequence_length=a.seq,
                    position_embedding_type="learned_absolute").to(device)


def patch_cpu_rng():
    """Megatron's own recompute saves CUDA RNG states; on CPU only the CPU one exists."""
    from megatron.core.tensor_parallel import random as mr
    mr._get_all_rng_states = lambda: (torch.get_rng_state(), None, mr.get_cuda_rng_tracker().get_states())

    def set_states(cpu, cuda, tracker):
        torch.set_rng_state(cpu)
        mr.get_cuda_rng_tracker().set_states(tracker)
    mr._set_all_rng_states = set_states


def measure(model, sample, applied, device, reps):
    """(storage-counter peak or None on CUDA, allocator peak, median seconds). The allocator
    peak is max_memory_allocated above the level before the step on CUDA, glibc's bytes in use
    (mallinfo2 after every op) above that level on CPU; it runs in an iteration of its own, since
    sampling every op slows it down."""
    from protrain.measure.heap_peak import HeapPeak

    def iteration():
        model(**sample).float().mean().backward()
    iteration()                                   # warm-up, gradients allocated
    model.zero_grad(set_to_none=False)
    if device.type != "cuda":
        applied.policy.reset_peak()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        iteration()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    counted = applied.policy.activation_peak() if device.type != "cuda" else None
    with HeapPeak(device) as heap:
        iteration()
        if counted is not None:
            applied.policy.activation_peak()      # leaves its counting mode (modes nest LIFO)
    return counted, heap.peak, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    dist.init_process_group("nccl" if cuda else "gloo")
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    if not cuda:
        patch_cpu_rng()
    from protrain_megatron import plan_activations
    from protrain_megatron.apply import profile_megatron

    model = build(a, device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.micro_batch, a.seq), generator=g).to(device)
    sample = {"input_ids": ids, "position_ids": torch.arange(a.seq, device=device).expand(a.micro_batch, -1),
              "attention_mask": None, "labels": torch.roll(ids, -1, 1)}
    t0 = time.perf_counter()
    profile = profile_megatron(model, sample, device=device, progress=False)
    profile_s = time.perf_counter() - t0
    rows = []
    for name, (pins, native) in PLANS.items():
        pins = pins(a.layers) if callable(pins) else pins
        applied = plan_activations(model, None, profile=profile, pins=pins, prefer_native=native,
                                   accounting=not cuda, verbose=False)
        try:
            how = applied.policy.how                # what is applied: read before close() undoes it
            counted, heap, seconds = measure(model, sample, applied, device, a.reps)
        finally:
            applied.close()
        p = applied.plan.prediction
        predicted_time = p.fwd_time + p.bwd_time
        pred = p.activation_peak_bytes
        rows.append({"plan": name, "modes": "".join(m.letter for m in applied.plan.block_modes),
                     "how": how, "predicted_activation_peak": pred,
                     "measured_activation_peak": int(counted) if counted is not None else None,
                     "peak_error": (pred - counted) / counted if counted else None,
                     "allocator_activation_peak": int(heap), "allocator_peak_error": (pred - heap) / heap,
                     "predicted_fwd_bwd_s": predicted_time, "measured_fwd_bwd_s": seconds,
                     "time_error": (predicted_time - seconds) / seconds})
    print("activation peak: predicted, storage counter (CPU), allocator (mallinfo2 on CPU, "
          "max_memory_allocated on CUDA)")
    print(f"{'plan':<16} {'modes':<10} {'pred':>10} {'counter':>10} {'err':>7} {'allocator':>10} {'err':>7} "
          f"{'time pred':>10} {'time meas':>10} {'err':>7}")
    for r in rows:
        counter = (f"{r['measured_activation_peak'] / 2**20:>8.1f}Mi {r['peak_error']:>+7.1%}"
                   if r["measured_activation_peak"] is not None else f"{'-':>10} {'-':>7}")
        print(f"{r['plan']:<16} {r['modes']:<10} {r['predicted_activation_peak'] / 2**20:>8.1f}Mi {counter} "
              f"{r['allocator_activation_peak'] / 2**20:>8.1f}Mi {r['allocator_peak_error']:>+7.1%} "
              f"{r['predicted_fwd_bwd_s'] * 1e3:>8.1f}ms {r['measured_fwd_bwd_s'] * 1e3:>8.1f}ms "
              f"{r['time_error']:>+7.1%}")
    dev = torch.cuda.get_device_name(0).replace(" ", "-") if cuda else "cpu"
    out = Path(a.out or f"bench/results/megatron_accuracy-{dev}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python bench/megatron_accuracy.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out"),
        "device": dev, "host": platform.processor() or platform.machine(), "profile_seconds": profile_s,
        "profile": profile.describe(), "results": rows}, indent=1))
    print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

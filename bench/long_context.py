"""The longest sequence that trains under one device budget, side by side in one run (issue 36):

- plain DeepSpeed ZeRO-0 (the model as it is);
- DeepSpeed with ALST's pieces set by hand: DeepSpeed's ``TiledMLP`` on every MLP (ALST's shard
  count, ceil(seq / hidden)), ``TiledFusedLogitsLoss`` for the head and loss, and every decoder
  layer checkpointed with its input in host memory (HF's ``gradient_checkpointing_kwargs=
  {"offload": True}``);
- ProTrain's own plan (``"protrain": {"enabled": true, "device_memory": <budget>}``).

Device bytes are counted on this CPU-only machine by the runtime's own accounting
(protrain.runtime.runtime.DeviceAccounting: the storages operators allocate, host copies
excluded) plus the model states DeepSpeed keeps on the device (fp32 parameters and two Adam
moments; gradients are counted as the operators make them). A length "trains" when a step's
counted peak stays within the budget (ProTrain: when it plans within the budget and its counted
peak stays there too). Lengths are multiples of 128, doubled then bisected. Then tokens/s, best
of ``--rounds`` interleaved steps, at each method's longest length and at ALST's longest.

    python bench/long_context.py                       # tiny HF Llama, fp32, 24 MiB budget
    python bench/long_context.py --budget 48MiB --layers 4
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import dstrain  # noqa: E402,F401  (the single-rank distributed environment)

import deepspeed  # noqa: E402
import transformers  # noqa: E402

from protrain.config import ConfigError  # noqa: E402
from protrain.runtime.runtime import DeviceAccounting  # noqa: E402
from protrain.search import InfeasibleError  # noqa: E402
from protrain.units import fmt_bytes, parse_bytes  # noqa: E402

GRANULE = 128
METHODS = ("deepspeed", "alst", "protrain")


def model(args):
    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=1 << 20, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def ds_config(method: str, budget: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if method == "protrain":
        cfg["protrain"] = {"enabled": True, "device_memory": budget, "accounting": True, "progress": False,
                           "verbosity": 0}
    return cfg


class ALST:
    """ALST's pieces on a Hugging Face Llama, by hand, as its paper and DeepSpeed's docstrings
    set them up; ``acc`` pauses the device count for the host copies."""

    def __init__(self, m, acc: DeviceAccounting):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
        self.m, self.acc = m, acc
        hidden = m.config.hidden_size
        for layer in m.model.layers:
            mlp = layer.mlp
            orig = mlp.forward

            def tiled(x, orig=orig, mlp=mlp):
                shards = max(1, math.ceil(x.shape[1] / hidden))
                return TiledMLP.apply(lambda self, t: orig(t), mlp, x, shards, list(mlp.parameters()))
            mlp.forward = tiled
            self._checkpoint_to_host(layer)
        self.loss_fn = TiledFusedLogitsLoss

    def _checkpoint_to_host(self, layer):
        orig, acc = layer.forward, self.acc

        def pack(t):
            with acc.paused():                       # the copy is in host memory
                return (t.device, t.detach().clone())

        def unpack(p):
            return p[1]

        def forward(*a, **k):
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return torch.utils.checkpoint.checkpoint(orig, *a, use_reentrant=False, **k)
        layer.forward = forward

    def loss(self, ids, labels):
        m = self.m
        hidden = m.model(input_ids=ids).last_hidden_state
        y = F.pad(labels, (0, 1), value=-100)[:, 1:]              # shifted labels
        shards = max(1, math.ceil(hidden.shape[1] / m.config.hidden_size))

        def fn(head, x, y):
            return F.cross_entropy(head(x).float().view(-1, m.config.vocab_size), y.reshape(-1),
                                   ignore_index=-100, reduction="sum")
        total = self.loss_fn.apply(fn, m.lm_head, hidden, y, None, shards, [m.lm_head.weight], "sum")
        return total / (y != -100).sum()


def run(method: str, seq: int, args, steps: int = 1) -> dict:
    """Train ``steps`` steps at ``seq``: counted peak, seconds per step (the last), or why not."""
    budget = args.budget
    m = model(args)
    cfg = ds_config(method, budget)
    engine = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)[0]
    numel = sum(p.numel() for p in m.parameters())
    acc = DeviceAccounting(torch.device("cpu")) if method != "protrain" else None
    alst = ALST(m, acc) if method == "alst" else None
    ids = torch.randint(0, args.vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    out = {"seq": seq}
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            if acc is not None:
                acc.begin()
            loss = alst.loss(ids, ids) if alst else engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            if acc is not None:
                acc.end(12 * numel)          # fp32 parameters and Adam's two moments
            out["seconds"] = time.perf_counter() - t0
        out["loss"] = loss.item()
        out["peak"] = acc.peak if acc is not None else engine.protrain_runtime.device_peak()
        if method == "protrain":
            plan = engine.protrain_plan
            out["predicted"] = plan.prediction.peak_device_bytes
            out["plan"] = {"modes": "".join(b.letter for b in plan.block_modes), "head_tile": plan.knobs.head_tile,
                           "mlp_tile": plan.knobs.mlp_tile, "ckpt_input": plan.knobs.ckpt_input,
                           "n_persist": plan.knobs.n_persist}
    except (InfeasibleError, ConfigError, RuntimeError) as e:
        if not isinstance(e, (InfeasibleError, ConfigError)) and "plan" not in str(e).lower() \
                and "fits" not in str(e):
            raise
        out["refused"] = str(e).splitlines()[0][:160]
    finally:
        engine.destroy()
    out["fits"] = "refused" not in out and out["peak"] <= budget
    return out


def longest(method: str, args) -> tuple[int, dict]:
    """The longest multiple of GRANULE that trains within the budget (doubling, then bisecting)."""
    lo, hi, best = 0, None, {}
    seq = args.start
    while hi is None:
        r = run(method, seq, args)
        print(f"  {method:9s} seq {seq:6d}: " + (f"peak {fmt_bytes(r['peak'])}" if "peak" in r else r.get("refused", ""))
              + (" fits" if r["fits"] else " does not fit"), flush=True)
        if r["fits"]:
            lo, best, seq = seq, r, seq * 2
        else:
            hi = seq
        if seq > args.max_seq:
            hi = seq
    while hi - lo > GRANULE:
        mid = (lo + hi) // 2 // GRANULE * GRANULE
        r = run(method, mid, args)
        print(f"  {method:9s} seq {mid:6d}: " + (f"peak {fmt_bytes(r['peak'])}" if "peak" in r else r.get("refused", ""))
              + (" fits" if r["fits"] else " does not fit"), flush=True)
        if r["fits"]:
            lo, best = mid, r
        else:
            hi = mid
    return lo, best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", default="24MiB", help="device memory every method gets")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--start", type=int, default=512, help="first length tried")
    ap.add_argument("--max-seq", type=int, default=1 << 16)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    args.budget = parse_bytes(args.budget)
    print(f"long_context: HF Llama {args.layers} layers x {args.hidden} hidden, vocab {args.vocab}, fp32, "
          f"micro-batch 1, device budget {fmt_bytes(args.budget)} (counted)", flush=True)
    found = {m: longest(m, args) for m in METHODS}
    lengths = sorted({found[m][0] for m in METHODS if found[m][0]})
    times: dict = {}
    for _ in range(args.rounds):        # interleaved: method by method within each round
        for seq in lengths:
            for m in METHODS:
                if found[m][0] >= seq:
                    r = run(m, seq, args, steps=2)
                    times.setdefault((m, seq), []).append(r["seconds"])
    print("\nmethod     longest   tokens/s there   tokens/s at ALST's longest   peak / budget")
    alst_len = found["alst"][0]
    rows = {}
    for m in METHODS:
        n, r = found[m]
        tps = n / min(times[(m, n)]) if n else 0.0
        at_alst = alst_len / min(times[(m, alst_len)]) if alst_len and (m, alst_len) in times else None
        rows[m] = {"longest": n, "tokens_per_s": tps, "tokens_per_s_at_alst_longest": at_alst, **r}
        print(f"{m:10s} {n:7d}   {tps:14.1f}   " + (f"{at_alst:26.1f}" if at_alst else f"{'-':>26s}")
              + f"   {fmt_bytes(r.get('peak', 0))} / {fmt_bytes(args.budget)}")
    if rows["protrain"].get("plan"):
        print(f"protrain's plan at its longest: {rows['protrain']['plan']}")
    if alst_len and rows["protrain"]["tokens_per_s_at_alst_longest"]:
        print(f"protrain / alst: longest {rows['protrain']['longest'] / alst_len:.2f}x, tokens/s at ALST's longest "
              f"{rows['protrain']['tokens_per_s_at_alst_longest'] / rows['alst']['tokens_per_s_at_alst_longest']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "results": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

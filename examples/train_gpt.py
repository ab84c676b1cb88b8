"""Train the built-in GPT with an ordinary DeepSpeed training loop.

Nothing here knows about ProTrain: the DeepSpeed config decides. With
``"protrain": {"enabled": true}`` in it, ProTrain profiles the model at the first step, prints
its plan and runs it; without, plain DeepSpeed runs.

    python examples/train_gpt.py --deepspeed_config configs/gpt_protrain.json
    deepspeed examples/train_gpt.py --deepspeed_config configs/gpt_protrain.json   # launcher

Data is synthetic (repeating token patterns a GPT can learn to continue), so the loss goes
down without any download. The model is gpt-tiny on CPU and gpt-small on a GPU unless
--model says otherwise.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from tqdm import tqdm

import deepspeed
from protrain.models import GPT, PRESETS, synthetic_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=list(PRESETS), default=None)
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    ap.add_argument("--patterns", type=int, default=8, help="distinct synthetic sequences")
    ap.add_argument("--local_rank", type=int, default=-1)
    ap = deepspeed.add_config_arguments(ap)
    args = ap.parse_args()
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"),
                 ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)   # a plain `python` launch is a one-process job

    cfg = PRESETS[args.model or ("gpt-small" if torch.cuda.is_available() else "gpt-tiny")]
    seq = args.seq or cfg.block_size
    torch.manual_seed(0)
    model = GPT(cfg)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=model.parameters())
    mb, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    print(f"training {args.model or 'default'} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
          f"params) for {args.steps} steps: micro-batch {mb} x {gas} accumulation, seq {seq}, "
          f"on {engine.device}", flush=True)
    first = last = None
    t0, tokens = None, 0
    bar = tqdm(range(args.steps), desc="train", unit="step", disable=engine.global_rank != 0)
    for step in bar:
        for micro in range(gas):
            x, y = synthetic_batch(cfg, mb, seq, device=engine.device,
                                   seed=(step * gas + micro) % args.patterns)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        last = loss.item()
        first = last if first is None else first
        if step == 0:
            t0 = time.perf_counter()      # the first step profiles and plans: not timed
        else:
            tokens += mb * gas * seq
        bar.set_postfix(loss=f"{last:.3f}", lr=f"{engine.get_lr()[0]:.2e}")
    elapsed = time.perf_counter() - t0 if t0 else 0.0
    rate = f", {tokens / elapsed:,.0f} tokens/s after the first step" if elapsed > 0 else ""
    print(f"loss {first:.3f} -> {last:.3f} over {engine.global_steps} steps{rate}", flush=True)
    if torch.cuda.is_available():
        print(f"peak device memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated", flush=True)
    engine.destroy()


if __name__ == "__main__":
    main()

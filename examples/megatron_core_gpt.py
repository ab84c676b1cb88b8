"""Train a megatron-core GPTModel with its own loop, activation memory planned by ProTrain.

One call, ``plan_activations(model, sample)``, profiles the built model on a sample batch,
plans keep / recompute / swap / NVMe per layer and applies it; the loop is unchanged.

    python examples/megatron_core_gpt.py                            # CPU or one GPU
    python examples/megatron_core_gpt.py --device-memory 2GiB       # a tighter budget
    python examples/megatron_core_gpt.py --no-protrain              # Megatron as built

Data is synthetic (repeating token patterns), so the loss goes down without a download. The
core attention is torch's SDPA on Megatron's [s, b, n, h] layout (runs on CPU too, where the
stock local attention cannot) and positions are learned.
"""
from __future__ import annotations

import argparse
import os

import torch
from tqdm import tqdm


def build(args, device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from protrain_megatron.sdpa_attention import SDPACoreAttention
    cfg = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            use_cpu_initialization=True, add_bias_linear=False,
                            hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.vocab,
                     max_sequence_length=args.seq, position_embedding_type="learned_absolute")
    return model.to(device)


def batch(args, step, device):
    """A few fixed random sequences, repeated: a GPT learns to continue them."""
    g = torch.Generator().manual_seed(step % args.patterns)
    ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g).to(device)
    pos = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.micro_batch, -1)
    return {"input_ids": ids[:, :-1], "position_ids": pos, "attention_mask": None, "labels": ids[:, 1:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--patterns", type=int, default=4)
    ap.add_argument("--device-memory", default=None, help="budget for the plan, e.g. 2GiB")
    ap.add_argument("--pin", action="append", default=[], metavar="KNOB=N",
                    help="n_checkpoint / n_swap / n_ssd (repeatable)")
    ap.add_argument("--ssd-path", default=None)
    ap.add_argument("--no-protrain", action="store_true")
    args = ap.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model = build(args, device)
    print(f"megatron-core GPT: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, "
          f"{args.layers} layers, micro-batch {args.micro_batch}, seq {args.seq}, on {device}", flush=True)

    applied = None
    if not args.no_protrain:
        from protrain.units import parse_bytes
        from protrain_megatron import plan_activations
        pins = {}
        for item in args.pin:
            k, _, v = item.partition("=")
            pins[k] = int(v)
        applied = plan_activations(
            model, batch(args, 0, device), pins=pins, ssd_path=args.ssd_path,
            device_memory=parse_bytes(args.device_memory, what="--device-memory") if args.device_memory else None)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = last = None
    for step in (bar := tqdm(range(args.steps), desc="train", unit="step")):
        loss = model(**batch(args, step, device)).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        last = loss.item()
        first = last if first is None else first
        bar.set_postfix(loss=f"{last:.3f}")
    print(f"loss {first:.3f} -> {last:.3f}", flush=True)
    if applied is not None:
        applied.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The analytic profile of a Megatron-LM pipeline stage, per tensor-parallel rank, from
Megatron-LM's arguments alone: what the context-parallel choice plans with at argument parsing
(no model exists yet), and what get_model falls back to when profiling the built model runs
out of device memory (a stage cannot run alone to be measured).
"""
from __future__ import annotations

from dataclasses import replace

from protrain.profile.transforms import scale_figures

ANALYTIC_PEAK_FLOPS = 400e12
"""Device FLOP/s assumed by the analytic stage profile when the probe has no published peak
(only the ratio of recompute to swap time depends on it)."""

DEFAULT_VOCAB = 32000
"""Vocabulary assumed when the arguments give none (the tokenizer sets it after parsing)."""

REPLICATED_SHARE = 10 / 34
"""Share of a layer's activations replicated on every tensor-parallel rank without sequence
parallelism (Korthikanti et al. 2022: 10 of the 34 sbh terms)."""


def stage_profile(args, n_layers: int, sizes: dict):
    """Analytic profile of this pipeline stage's layers, per tensor-parallel rank (an
    estimate: a stage cannot run alone to be measured)."""
    return analytic_stage_profile(args, n_layers, args.seq_length // max(1, sizes["cp"]), sizes["tp"],
                                  name=f"megatron-stage{sizes['pp_rank']}")


def model_shape(args, n_layers: int, seq_len: int, name: str = "megatron"):
    """The analytic model shape of ``n_layers`` layers of Megatron-LM's model from its
    arguments (also before validate_args: unset sizes take Megatron's defaults)."""
    from protrain.profile.analytic import ModelShape
    half = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
    heads = args.num_attention_heads
    groups = getattr(args, "num_query_groups", None)
    vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size or DEFAULT_VOCAB
    return ModelShape(
        name=name, family="llama" if getattr(args, "swiglu", False) else "gpt2",
        n_layers=n_layers, hidden=args.hidden_size, heads=heads, vocab=vocab,
        seq_len=seq_len, micro_batch=args.micro_batch_size,
        kv_heads=groups if getattr(args, "group_query_attention", False) and groups else None,
        ffn_hidden=getattr(args, "ffn_hidden_size", None),
        tied_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
        max_positions=getattr(args, "max_position_embeddings", None), dtype_bytes=2 if half else 4)


def analytic_stage_profile(args, n_layers: int, seq_len: int, tp: int, *, hardware=None,
                           name: str = "megatron"):
    """The analytic profile of ``n_layers`` layers at ``seq_len`` tokens, per
    tensor-parallel rank of ``tp``."""
    from protrain.profile.analytic import analytic_profile
    if hardware is None:
        from .apply import _probe
        hardware = _probe(None, False)          # the node's entry, shared by its ranks
    hw = hardware
    if hw.peak_flops <= 0:
        hw = replace(hw, peak_flops=ANALYTIC_PEAK_FLOPS)
    if getattr(args, "sequence_parallel", False):
        share = 1 / tp
    else:
        share = REPLICATED_SHARE + (1 - REPLICATED_SHARE) / tp
    profile = analytic_profile(model_shape(args, n_layers, seq_len, name), hw)
    return scale_figures(profile, memory=share, time=1 / tp, io=1 / tp)

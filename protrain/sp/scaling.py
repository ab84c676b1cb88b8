"""A profile measured at one batch shape on one rank, rescaled to another micro-batch and
sequence length split over P ranks (Ulysses): the per-rank profile the search plans with for
each P, and for a batch longer than the one profiled (the engine's shape re-plan).

Measured once at micro-batch b0 and sequence s0 (the user's first batch, or a shorter
sequence when the user's does not fit the device while profiling), for a target micro-batch b,
sequence s and degree P each rank holds (b / b0) s / P tokens per profiled sample:

- time outside attention (projections, norms, MLP, embedding, head, loss) is linear in the
  tokens a rank holds: x (b / b0) (s / s0) / P;
- attention time is quadratic in the sequence, linear in the batch and split over the heads:
  x (b / b0) (s / s0)^2 / P;
- every activation byte figure is affine in the tokens a rank holds: activations grow with
  them, while the parameter gradients that pass through the device in backward (and the tied
  embedding's) do not. Given a second profile at another length (``second``, the engine takes
  one at half the sequence) each figure is fitted through both; from one profile it is taken
  as linear, which errs high when scaling up and low by the parameter gradients when
  splitting. A peak is the largest of several such lines, and between two short profiles the
  fit may follow one that a steeper line overtakes further on (a 4-layer GPT's head: its
  backward peak fitted through 8 and 16 tokens is 6% low at 64), while the linear rule bounds
  every line that does not start below zero: so the planner fits only where a rank holds
  fewer tokens than were measured (protrain.sp.planner). Either way attention is assumed to
  keep no s x s matrix (flash / memory-efficient kernels, which
  F.scaled_dot_product_attention uses without a mask); a math-kernel model's attention memory
  would grow faster;
- with P > 1 each block adds Ulysses' all-to-alls: forward moves the attention operator's
  query, key, value and output per rank, (P - 1) / P of them leaving the rank, backward the
  same gradients (key/value replicated P / kv_heads times when P exceeds the KV heads). The
  attention output comes back from its all-to-all as a tensor of its own, which the output
  projection saves next to the attention operator's own output (without sequence parallelism
  the projection saves a view of it): one output's bytes more per block and rank, kept from
  that block's forward to its backward. The selective mode keeps the all-to-alls' outputs
  too.

tests/test_sp_scaling.py checks a profile taken at s0 and scaled against one measured at s.
"""
from __future__ import annotations

from dataclasses import replace

from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile, PartProfile


def alltoall_bandwidth(hw: HardwareProfile) -> float:
    """The all-to-all bandwidth to plan with: measured, else the data-parallel collectives'."""
    return hw.alltoall_bandwidth or hw.collective_bandwidth


def alltoall_bytes(part: PartProfile, profile: ModelProfile, degree: int) -> float:
    """Bytes one rank's all-to-alls send per direction for ``part`` of ``profile`` (already
    per rank: scaled) at degree P: the attention operator's inputs and output with key/value
    replicated when P exceeds the KV heads, (P - 1) / P of them leaving the rank."""
    if degree <= 1 or not part.attn_io_bytes:
        return 0.0
    h = profile.heads or 1
    kv = profile.kv_heads or h
    repl = max(1.0, degree / kv)
    io = part.attn_io_bytes * (h + kv * repl) / (h + kv)
    return io * (degree - 1) / degree


_BYTES = ("in_bytes", "saved_bytes", "fwd_start", "fwd_peak", "bwd_start", "bwd_peak",
          "attn_io_bytes", "sel_saved_bytes", "kept_bytes", "resaved_bytes", "in_shared_bytes")


def scale_profile(profile: ModelProfile, *, seq_len: int | None = None, degree: int = 1,
                  alltoall_bandwidth: float = 0.0, second: ModelProfile | None = None,
                  micro_batch: int | None = None) -> ModelProfile:
    """The per-rank profile of ``profile`` at ``micro_batch`` samples (default: the profile's)
    of ``seq_len`` tokens split over ``degree`` ranks (``second``: the same model and batch
    profiled at another sequence length, for the byte figures). A profile of a batch without
    a sequence (``seq_len`` None: features, images) scales with the samples alone, on one rank."""
    if profile.sequence_parallel != 1:
        raise ValueError("scale_profile takes a profile measured on one rank (sequence_parallel=1)")
    s0 = profile.seq_len
    s = seq_len or s0
    if s0 is None and seq_len is None and degree == 1 and second is None:
        s0 = s = 1        # no sequence: every figure per sample
    if not s0:
        raise ValueError("the profile does not record its sequence length; it cannot be rescaled")
    b0 = profile.micro_batch
    b = micro_batch or b0
    if b != b0 and not b0:
        raise ValueError("the profile does not record its micro-batch; it cannot be rescaled to "
                         f"micro-batch {b}")
    per_sample = b / b0 if b != b0 else 1.0
    lin = s / s0 * per_sample / degree
    quad = (s / s0) ** 2 * per_sample / degree
    if degree > 1 and alltoall_bandwidth <= 0 and any(p.attn_io_bytes for p in profile.parts):
        raise ValueError("planning sequence parallelism needs the all-to-all bandwidth (probe the "
                         "machine with the ranks launched, or use a named GPU)")

    tokens = s * per_sample / degree
    if second is not None and (second.seq_len == s0 or len(second.parts) != len(profile.parts)
                               or second.micro_batch != b0):
        raise ValueError("scale_profile: the second profile must be of the same model and "
                         "micro-batch at another sequence length")

    def fit(p0, p1, field: str) -> int:
        v0 = getattr(p0, field)
        if p1 is None:
            return int(round(v0 * tokens / s0))
        v1 = getattr(p1, field)
        if field == "sel_saved_bytes" and not (v0 and v1):
            return 0
        return max(int(round(v0 + (v1 - v0) * (tokens - s0) / (second.seq_len - s0))), 0)

    h = profile.heads or 1
    kv = profile.kv_heads or h
    parts = []
    held = 0               # extra bytes saved by the blocks so far (the all-to-all outputs)
    for k, p in enumerate(profile.parts):
        p1 = second.parts[k] if second is not None else None
        scaled = replace(p, **{f: fit(p, p1, f) for f in _BYTES},
                         attn_fwd_time=p.attn_fwd_time * quad, attn_bwd_time=p.attn_bwd_time * quad)
        comm = alltoall_bytes(scaled, profile, degree) / alltoall_bandwidth if degree > 1 and \
            alltoall_bandwidth > 0 else 0.0
        kept_comm = scaled.attn_io_bytes if degree > 1 else 0
        extra = int(scaled.attn_io_bytes * h / (2 * h + 2 * kv)) if degree > 1 and p.kind == "block" else 0
        parts.append(replace(
            scaled,
            fwd_time=(p.fwd_time - p.attn_fwd_time) * lin + scaled.attn_fwd_time + comm,
            bwd_time=(p.bwd_time - p.attn_bwd_time) * lin + scaled.attn_bwd_time + comm,
            comm_fwd_time=comm, comm_bwd_time=comm,
            saved_bytes=scaled.saved_bytes + extra,
            fwd_start=scaled.fwd_start + held, fwd_peak=scaled.fwd_peak + held + extra,
            bwd_start=scaled.bwd_start + held + extra, bwd_peak=scaled.bwd_peak + held + extra,
            sel_saved_bytes=scaled.sel_saved_bytes + kept_comm if scaled.sel_saved_bytes else 0))
        held += extra
    return replace(profile, parts=tuple(parts), seq_len=s if profile.seq_len else None, micro_batch=b,
                   sequence_parallel=degree,
                   ops=(), name=profile.name)

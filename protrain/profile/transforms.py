"""A measured or analytic profile with its figures multiplied by constant factors: what a
rank holds when it keeps several micro-batches' activations (a pipeline stage), or a share of
every activation and FLOP (a tensor-parallel rank).

Rescaling to another batch shape or sequence-parallel degree, where figures are not simply
proportional (attention grows with the square of the sequence, the all-to-alls add their own),
is protrain.sp.scaling.scale_profile.
"""
from __future__ import annotations

from dataclasses import replace

from .model_profile import ModelProfile


def scale_figures(profile: ModelProfile, *, memory: float = 1.0, time: float = 1.0,
                  io: float | None = None) -> ModelProfile:
    """Every activation figure times ``memory``, every compute time times ``time``, the
    attention operator's input/output bytes (what context parallelism's all-to-alls move)
    times ``io`` (default ``memory``)."""
    m = lambda x: int(round(x * memory))  # noqa: E731
    io = memory if io is None else io
    parts = tuple(replace(p, in_bytes=m(p.in_bytes), saved_bytes=m(p.saved_bytes),
                          kept_bytes=m(p.kept_bytes), resaved_bytes=m(p.resaved_bytes),
                          in_shared_bytes=m(p.in_shared_bytes), sel_saved_bytes=m(p.sel_saved_bytes),
                          fwd_start=m(p.fwd_start), fwd_peak=m(p.fwd_peak), bwd_start=m(p.bwd_start),
                          bwd_peak=m(p.bwd_peak), fwd_time=p.fwd_time * time, bwd_time=p.bwd_time * time,
                          attn_fwd_time=p.attn_fwd_time * time, attn_bwd_time=p.attn_bwd_time * time,
                          attn_io_bytes=int(round(p.attn_io_bytes * io)))
                  for p in profile.parts)
    return replace(profile, parts=parts, ops=())

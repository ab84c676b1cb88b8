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
    # A pipeline stage or tensor-parallel share (Megatron) computes its loss outside the model:
    # no tiled head there; its layers' MLPs are Megatron's (not tiled by ProTrain's hooks).
    return replace(profile, parts=parts, ops=(), head=None, mlp=None)


def with_head_tile(profile: ModelProfile, tile: int) -> ModelProfile:
    """``profile`` with its head and loss over tiles of ``tile`` tokens (0: the model's own
    head): the post part's figures moved as ``profile.head`` says (model_profile.HeadProfile)."""
    if tile == profile.head_tile:
        return profile
    if profile.head_tile:
        raise ValueError(f"with_head_tile: the profile is already tiled ({profile.head_tile} tokens)")
    h, n = profile.head, profile.tokens
    if h is None or n is None:
        raise ValueError("with_head_tile: the profile has no tiled head "
                         f"({profile.head_unsupported or 'not measured, or no batch shape'})")
    t = min(tile, n)
    post = profile.parts[-1]
    b = lambda per_token, per_tile=0.0: int(round(per_token * n + per_tile * t))  # noqa: E731
    tiled = replace(post, saved_bytes=max(post.saved_bytes + b(h.saved_per_token), 0),
                    fwd_peak=max(post.fwd_peak + b(h.fwd_peak_per_token, h.fwd_peak_per_tile_token), post.fwd_start),
                    bwd_start=max(post.bwd_start + b(h.bwd_start_per_token), 0),
                    bwd_peak=post.bwd_peak + b(h.bwd_peak_per_token, h.bwd_peak_per_tile_token)
                    + int(h.bwd_peak_fixed),
                    bwd_time=post.bwd_time + h.bwd_time_per_token * n)
    tiled = replace(tiled, bwd_peak=max(tiled.bwd_peak, tiled.bwd_start))
    held = b(h.held_per_token)
    before = tuple(replace(p, bwd_start=max(p.bwd_start + held, 0), bwd_peak=max(p.bwd_peak + held, 0))
                   for p in profile.parts[:-1]) if held else profile.parts[:-1]
    return replace(profile, parts=before + (tiled,), head_tile=tile, ops=())


def with_mlp_tile(profile: ModelProfile, tile: int) -> ModelProfile:
    """``profile`` with every block's MLP over tiles of ``tile`` tokens (0: the model's own
    MLPs): each block's saved bytes and excursions moved as ``profile.mlp`` says
    (model_profile.MLPProfile), and every later level lower by what the earlier blocks no longer
    save."""
    if tile == profile.mlp_tile:
        return profile
    if profile.mlp_tile:
        raise ValueError(f"with_mlp_tile: the profile is already tiled ({profile.mlp_tile} tokens)")
    m, n = profile.mlp, profile.tokens
    if m is None or n is None:
        raise ValueError("with_mlp_tile: the profile has no tiled MLP "
                         f"({profile.mlp_unsupported or 'not measured, or no batch shape'})")
    if tile >= n:
        # One tile: the runtime runs the MLP as it is (tiled_mlp), so the figures are the untiled.
        return replace(profile, mlp_tile=tile, ops=())
    t = max(tile, m.shortest_tile * n)
    b = lambda per_token, per_tile=0.0: int(round(per_token * n + per_tile * t))  # noqa: E731
    d_saved = b(m.saved_per_token)
    d_fwd = b(m.fwd_peak_per_token, m.fwd_peak_per_tile_token)
    d_bwd = b(m.bwd_peak_per_token, m.bwd_peak_per_tile_token) + int(m.bwd_peak_fixed)
    parts, shift = [], 0                    # shift: what the blocks before no longer save
    for p in profile.parts:
        if p.kind != "block":
            parts.append(replace(p, fwd_start=p.fwd_start + shift, fwd_peak=p.fwd_peak + shift,
                                 bwd_start=p.bwd_start + (shift if p.kind == "post" else 0),
                                 bwd_peak=p.bwd_peak + (shift if p.kind == "post" else 0)))
            continue
        saved = max(p.saved_bytes + d_saved, p.in_bytes)
        gone = saved - p.saved_bytes
        fwd_start = p.fwd_start + shift
        fwd_peak = max(p.fwd_peak + shift + d_fwd, fwd_start)
        bwd_start = p.bwd_start + shift + gone
        bwd_peak = max(p.bwd_peak + shift + gone + d_bwd, bwd_start)
        parts.append(replace(p, saved_bytes=saved, fwd_start=fwd_start, fwd_peak=fwd_peak,
                             bwd_start=bwd_start, bwd_peak=bwd_peak,
                             bwd_time=p.bwd_time + m.bwd_time_per_token * n))
        shift += gone
    return replace(profile, parts=tuple(parts), mlp_tile=tile, ops=())

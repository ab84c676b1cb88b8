"""DeepSpeed's ZeRO-3 checkpoint files beside ProTrain's, for DeepSpeed's recovery tools.

A user whose JSON says ZeRO stage 1-3 gets its weights out of a checkpoint with DeepSpeed's
tools: the ``zero_to_fp32.py`` script DeepSpeed copies next to the tags,
``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` and
``load_state_dict_from_zero_checkpoint``. They read ``*_model_states.pt`` and
``*_optim_states.pt`` files, which ProTrain's own layout (per-rank pieces of chunks) does not
have. So such a save also writes, per rank, the two files a ZeRO-3 save would:

- ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: ``fp32_flat_groups``, the rank's ZeRO-3
  partition of every trainable parameter's fp32 master in order (each parameter split into
  ``world`` parts of ceil(numel / world) elements, the last padded with zeros), with
  ``zero_stage`` 3 and ``partition_count``; no Adam moments (ProTrain's own files hold them);
- ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``: the buffers, the parameter shapes, the
  frozen parameters' partitions and the shared (tied) parameter names.

Each rank cuts its partition out of every rank's ProTrain pieces, written just before (read
through memory maps: one parameter's slice at a time besides the flat group itself, which is
what DeepSpeed's own save holds). 4 bytes per parameter more on the drive per checkpoint.
"""
from __future__ import annotations

import math
import shutil
from collections import OrderedDict
from pathlib import Path

import torch

from protrain.runtime.states import Piece


def optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def files(world: int) -> set[str]:
    return {f(r) for r in range(world) for f in (optim_file, model_file)}


def _partition(n: int, world: int, rank: int) -> tuple[int, int, int]:
    """(lo, hi, size) of ``rank``'s ZeRO-3 partition of a parameter of ``n`` elements."""
    size = math.ceil(n / world)
    lo = min(n, rank * size)
    return lo, min(n, lo + size), size


def _master_slice(pieces: list[Piece], lo: int, hi: int, out: torch.Tensor) -> None:
    """The fp32 master's elements [lo, hi) of one parameter, from the pieces covering them."""
    for p in pieces:
        a, b = max(p.lo, lo), min(p.hi, hi)
        if a < b:
            out[a - lo:b - lo].copy_(p.master[a - p.lo:b - p.lo])


def write(directory: Path, rank: int, world: int, shapes: dict[str, list[int]],
          pieces: dict[str, list[Piece]], extra_state: dict, module: torch.nn.Module, save) -> None:
    """This rank's two ZeRO-3 files into ``directory`` (``save(obj, path)`` writes durably).
    ``shapes``: the trainable parameters (name -> shape) in order; ``pieces``: every rank's
    pieces by name; ``extra_state``: the module's state besides them (buffers, frozen
    parameters)."""
    import deepspeed
    total = sum(_partition(math.prod(s), world, rank)[2] for s in shapes.values())
    flat = torch.zeros(total, dtype=torch.float32)
    at = 0
    for name, shape in shapes.items():
        lo, hi, size = _partition(math.prod(shape), world, rank)
        if lo < hi:
            _master_slice(pieces[name], lo, hi, flat[at:at + hi - lo])
        at += size
    save({"optimizer_state_dict": {"zero_stage": 3, "partition_count": world,
                                   "fp32_flat_groups": [flat]},
          "ds_version": deepspeed.__version__}, directory / optim_file(rank))
    del flat
    buffers = {n for n, _ in module.named_buffers()}
    frozen = {n: t for n, t in extra_state.items() if n not in buffers}
    fragments = {}
    for name, t in frozen.items():
        lo, hi, size = _partition(t.numel(), world, rank)
        part = torch.zeros(size, dtype=t.dtype)
        part[:hi - lo].copy_(t.reshape(-1)[lo:hi])
        fragments[name] = part
    seen: dict[int, str] = {}
    shared = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            shared[name] = seen[id(p)]
        else:
            seen[id(p)] = name
    save({"module": {n: t for n, t in extra_state.items() if n in buffers},
          "buffer_names": sorted(buffers & set(extra_state)),
          "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in shapes.items())],
          "frozen_param_shapes": OrderedDict((n, t.shape) for n, t in frozen.items()),
          "frozen_param_fragments": fragments, "shared_params": shared,
          "ds_version": deepspeed.__version__}, directory / model_file(rank))


def copy_recovery_script(save_dir: Path) -> None:
    """DeepSpeed's zero_to_fp32.py next to the tags, where its ZeRO saves put it."""
    import deepspeed.utils.zero_to_fp32 as script
    target = save_dir / "zero_to_fp32.py"
    if not target.exists():
        shutil.copyfile(script.__file__, target)

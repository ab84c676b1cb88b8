"""DeepSpeed's own checkpoint files beside ProTrain's, for DeepSpeed's tools and for scripts.

Users get their weights out of a DeepSpeed checkpoint in DeepSpeed's ways: ``torch.load`` of
``<tag>/mp_rank_00_model_states.pt`` and its ``module`` (ZeRO 0-2), a plain DeepSpeed engine's
``load_checkpoint(..., load_module_only=True)``, the ``zero_to_fp32.py`` script DeepSpeed copies
next to the tags, ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` and
``load_state_dict_from_zero_checkpoint`` (ZeRO 1-3). ProTrain's own layout (per-rank pieces of
chunks) has none of those files, so a save also writes the ones a plain DeepSpeed save with the
JSON's ZeRO stage would (the "layout"):

- stage 0 (or none): ``mp_rank_00_model_states.pt`` (rank 0): ``module`` - the model's
  state_dict in its training dtype, every parameter (tied ones under each name), buffer and
  frozen parameter (but those ``exclude_frozen_parameters`` leaves out) - and DeepSpeed's
  counters, LR scheduler state and ``client_state`` keys; ``optimizer`` is None (the Adam
  states are in ProTrain's files);
- stages 1 and 2: that file, with ZeRO-2's ``param_shapes`` (per param group),
  ``frozen_param_shapes`` / ``frozen_param_fragments`` and ``shared_params``, and per rank
  ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: ``single_partition_of_fp32_groups``, the
  rank's part of each param group's fp32 masters laid end to end (padded with zeros to a
  multiple of 2 x world, as ZeRO-2 aligns), ``zero_stage`` 2, ``partition_count``;
- stage 3: per rank ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (``fp32_flat_groups``, the
  rank's ZeRO-3 partition of every trainable parameter's fp32 master in order: each split into
  ``world`` parts of ceil(numel / world) elements, the last padded with zeros) and
  ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (the buffers, the parameter shapes, the
  frozen parameters' partitions and the shared parameter names).

No Adam moments: a plain DeepSpeed engine takes the module (and counters) from them, not the
optimizer; ProTrain's own files resume everything. Each rank cuts its part out of every rank's
ProTrain pieces, written just before (read through memory maps: one parameter's slice at a
time besides what is written, which is what DeepSpeed's own save holds): 4 bytes per
parameter more on the drive per checkpoint with a ZeRO stage, the model's size in its dtype
with stages 0-2.
"""
from __future__ import annotations

import math
import shutil
from collections import OrderedDict
from pathlib import Path

import torch

from protrain.runtime.states import Piece


MODULE_FILE = "mp_rank_00_model_states.pt"
"""ZeRO 0-2's model file (rank 0): the whole module."""


def optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def layout(zero_stage: int) -> int:
    """The DeepSpeed files a save writes for the JSON's ZeRO stage: 0, 2 (stages 1 and 2
    write the same files) or 3."""
    return 3 if zero_stage >= 3 else (2 if zero_stage >= 1 else 0)


def files(world: int, kind: int = 3) -> set[str]:
    """The names of a checkpoint's DeepSpeed files for ``world`` ranks in layout ``kind``."""
    if kind == 3:
        return {f(r) for r in range(world) for f in (optim_file, model_file)}
    return {MODULE_FILE} | ({optim_file(r) for r in range(world)} if kind == 2 else set())


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
          pieces: dict[str, list[Piece]], extra_state: dict, module: torch.nn.Module, save,
          kind: int = 3, groups: list[list[str]] | None = None, engine_state: dict | None = None,
          keys: list[str] | None = None) -> None:
    """This rank's DeepSpeed files of layout ``kind`` into ``directory`` (``save(obj, path)``
    writes durably). ``shapes``: the trainable parameters (name -> shape) in order;
    ``pieces``: every rank's pieces by name; ``extra_state``: the module's state besides them
    (buffers, frozen parameters); ``groups``: the trainable parameters' names per param group
    (layout 2); ``engine_state``: DeepSpeed's counters and client_state for the module file
    (layouts 0 and 2); ``keys``: the module's state_dict keys in order (default: its
    parameters' and persistent buffers' names, module by module)."""
    if kind == 3:
        _write_zero3(directory, rank, world, shapes, pieces, extra_state, module, save)
        return
    if kind == 2:
        _write_zero2_optim(directory, rank, world, shapes, pieces, groups, save)
    if rank == 0:
        _write_module_file(directory, shapes, pieces, extra_state, module, save,
                           groups if kind == 2 else None, engine_state or {},
                           keys if keys is not None else _state_keys(module))


def _write_zero2_optim(directory: Path, rank: int, world: int, shapes: dict[str, list[int]],
                       pieces: dict[str, list[Piece]], groups: list[list[str]], save) -> None:
    """ZeRO-2's optimizer file of ``rank``: per param group, its part of the group's fp32
    masters laid end to end, the whole padded to a multiple of 2 x world."""
    import deepspeed
    parts = []
    for names in groups:
        total = sum(math.prod(shapes[n]) for n in names)
        size = math.ceil(total / (2 * world)) * 2
        part = torch.zeros(size, dtype=torch.float32)
        lo, hi, at = rank * size, (rank + 1) * size, 0
        for n in names:
            numel = math.prod(shapes[n])
            a, b = max(lo, at), min(hi, at + numel)
            if a < b:
                _master_slice(pieces[n], a - at, b - at, part[a - lo:b - lo])
            at += numel
        parts.append(part)
    save({"optimizer_state_dict": {"zero_stage": 2, "partition_count": world,
                                   "single_partition_of_fp32_groups": parts},
          "ds_version": deepspeed.__version__}, directory / optim_file(rank))


def _write_module_file(directory: Path, shapes: dict[str, list[int]], pieces: dict[str, list[Piece]],
                       extra_state: dict, module: torch.nn.Module, save,
                       groups: list[list[str]] | None, engine_state: dict, keys: list[str]) -> None:
    """ZeRO 0-2's ``mp_rank_00_model_states.pt``: the module's state_dict in its own key order
    and dtypes (trainable parameters from the fp32 masters, cast as the training dtype holds
    them), and the keys DeepSpeed's ``load_checkpoint`` and ``zero_to_fp32`` read.

    The trainable parameters are cast one at a time into a scratch file mapped shared (page
    cache the kernel writes back, not process memory) and saved from there: at 70B the
    module is 140 GB in bf16, which must not be assembled in host memory (issue 35, item 6)."""
    import deepspeed
    import numpy as np
    canonical, dtypes = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(p), name)
        dtypes[first] = p.dtype
    alias = {name: canonical[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}
    order = list(dict.fromkeys(alias.get(k, k) for k in keys if alias.get(k, k) in shapes))
    sizes = {n: math.prod(shapes[n]) * dtypes[n].itemsize for n in order}
    offsets, at = {}, 0
    for n in order:
        offsets[n] = at
        at += -(-sizes[n] // 64) * 64              # every tensor 64-byte aligned
    scratch = directory / ".module.scratch"
    mapped = np.memmap(scratch, dtype=np.uint8, mode="w+", shape=(max(at, 1),))
    try:
        built: dict[str, torch.Tensor] = {}
        for n in order:
            flat = torch.from_numpy(mapped[offsets[n]:offsets[n] + sizes[n]]).view(dtypes[n])
            _master_slice(pieces[n], 0, flat.numel(), flat)      # copy_ casts as .to() does
            built[n] = flat.view(shapes[n])
        state = OrderedDict()
        for key in keys:
            name = alias.get(key, key)
            if name in built:
                state[key] = built[name]
            elif key in extra_state:
                state[key] = extra_state[key]
            elif name in extra_state:                   # a frozen parameter under a tied name
                state[key] = extra_state[name]
        _save_module_file(directory, state, extra_state, module, shapes, groups, alias,
                          engine_state, save, deepspeed.__version__)
    finally:
        del mapped
        scratch.unlink(missing_ok=True)


def _save_module_file(directory: Path, state: OrderedDict, extra_state: dict, module: torch.nn.Module,
                      shapes: dict[str, list[int]], groups: list[list[str]] | None, alias: dict[str, str],
                      engine_state: dict, save, ds_version: str) -> None:
    """The module file around ``state``: ZeRO-2's shapes and fragments, DeepSpeed's counters,
    the client's keys."""
    buffers = {n for n, _ in module.named_buffers()}
    frozen = OrderedDict((n, t) for n, t in extra_state.items() if n not in buffers)
    shared = {name: first for name, first in alias.items() if name != first}
    out = {"module": state, "buffer_names": sorted(buffers & set(extra_state)), "optimizer": None,
           "param_shapes": [OrderedDict((n, torch.Size(shapes[n])) for n in names)
                            for names in (groups if groups is not None else [list(shapes)])],
           "frozen_param_shapes": OrderedDict((n, t.shape) for n, t in frozen.items()),
           "frozen_param_fragments": frozen, "shared_params": shared,
           "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
           "sparse_tensor_module_names": set(), "skipped_steps": 0, "global_steps": 0,
           "global_samples": 0, "dp_world_size": 1, "mp_world_size": 1,
           "ds_version": ds_version}
    client = engine_state.get("client_state") or {}
    out.update({k: v for k, v in engine_state.items() if k != "client_state"})
    out.update(client)
    save(out, directory / MODULE_FILE)


def _state_keys(module: torch.nn.Module) -> list[str]:
    """The module's state_dict keys in order, without reading a tensor (a sharded parameter's
    ``.data`` is empty between uses)."""
    keys = []

    def walk(m: torch.nn.Module, prefix: str) -> None:
        for n, p in m._parameters.items():
            if p is not None:
                keys.append(prefix + n)
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                keys.append(prefix + n)
        for n, child in m._modules.items():
            if child is not None:
                walk(child, prefix + n + ".")
    walk(module, "")
    return keys


def _write_zero3(directory: Path, rank: int, world: int, shapes: dict[str, list[int]],
                 pieces: dict[str, list[Piece]], extra_state: dict, module: torch.nn.Module, save) -> None:
    """This rank's two ZeRO-3 files."""
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

"""User-facing planner settings: memory limits, knob pins, margins. Strictly validated.

The same settings come from a DeepSpeed JSON's ``"protrain"`` section, Megatron flags or the
``protrain plan`` command line; all of them go through ``PlannerConfig.from_dict`` so a typo
fails the same way everywhere: with the key, the value seen and what to write instead.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping

from .units import MiB, parse_bytes

KNOB_NAMES = ("chunk_size", "n_persist", "n_buffer", "n_swap", "n_checkpoint", "n_ssd",
              "n_selective", "sequence_parallel", "n_nvme", "n_shard", "head_tile", "mlp_tile",
              "ckpt_input")
MAX_COUNT = 2**31 - 1
"""Largest count a setting takes (chunks, blocks, steps, ranks): the search holds them in int64
arrays and multiplies them by sizes."""
ALL = "all"
"""``n_persist`` pinned to every chunk (the count depends on the chunk size)."""


class ConfigError(ValueError):
    """A setting is unknown or has a value that cannot work. The message names the key."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KnobPins:
    """Knobs the user fixes; the search fills in every knob left as None."""

    chunk_size: int | None = None
    """Chunk capacity in bytes (parameters are packed into chunks of this size)."""
    n_persist: int | str | None = None
    """Number of leading chunks that stay on the device all iteration (updated by device Adam);
    ``"all"``: every chunk (keep the whole model on the device)."""
    n_buffer: int | None = None
    """Number of device chunk buffers that receive the other chunks ahead of use."""
    n_swap: int | None = None
    """Number of blocks whose saved activations go to host memory in forward."""
    n_checkpoint: int | None = None
    """Number of blocks recomputed in backward instead of keeping their activations."""
    n_ssd: int | None = None
    """Number of blocks whose saved activations go to NVMe (needs an SSD path)."""
    n_selective: int | None = None
    """Number of blocks under long-context selective checkpointing (attention outputs kept,
    the rest recomputed in backward)."""
    sequence_parallel: int | None = None
    """Ulysses sequence-parallel degree P (ranks that split each sequence); None: the planner
    chooses among the degrees the world size, head counts and sequence length allow."""

    n_nvme: int | None = None
    """Number of offloaded chunks whose optimizer states live on NVMe (the last ones; needs an
    SSD path)."""
    n_shard: int | None = None
    """Number of persistent chunks (the last ones) sharded over the data-parallel ranks: each
    rank keeps 1/world of their states on its device and gathers them ahead of use."""
    head_tile: int | None = None
    """Tokens per tile of the head and loss (0: the model's own head, whole logits); None: the
    planner tiles where that lets a faster plan fit (protrain.search.head)."""
    mlp_tile: int | None = None
    """Tokens per tile of every block's MLP (0: the model's own MLPs); None: the planner tiles
    where that lets a faster plan fit (protrain.search.mlp)."""
    ckpt_input: str | None = None
    """Where the checkpointed blocks keep their inputs: ``"device"`` (torch checkpoint's way),
    ``"host"`` (pinned host memory, copied back one block ahead of the block's backward; HF's
    ``gradient_checkpointing_kwargs={"offload": True}``) or ``"drive"`` (the NVMe path; needs
    ``ssd_path``); None: the planner moves them where that lets a faster plan fit
    (protrain.search.ckpt_input)."""

    def pinned(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in KNOB_NAMES if getattr(self, k) is not None}


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    """How the planner may use the machine."""

    device_memory: int | None = None
    """Device bytes the plan may use. None: the measured (or named machine's) capacity."""
    host_memory: int | None = None
    """The node's host bytes for offloaded model states and swapped activations
    (``HardwareProfile.host_memory``, what ``free`` shows): each of the node's ranks plans for
    1/ranks_per_node of it. None: this rank's share of what the host can give, less
    ``host_reserve`` (``session.host_budget``)."""
    host_reserve: float = 0.10
    """Share of this rank's host memory left alone for the data loader, the OS and the
    framework when host_memory is not set."""
    memory_margin: float = 0.10
    """Allocator fragmentation margin: a plan fits when its predicted peak times (1 + margin)
    fits the device memory. ProTrain's paper leaves about 10%."""
    chunk_sizes: tuple[int, ...] = (32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB)
    """Chunk capacities the search tries (bytes). Sizes below the largest parameter are
    skipped; if all are, the largest parameter's size (rounded up to 1 MiB) is used."""
    pins: KnobPins = field(default_factory=KnobPins)
    """Knobs fixed by the user."""
    time_tolerance: float = 0.05
    """Relative error of the runtime model: plans predicted within it of the fastest are taken
    as equally fast, and the one among them that moves the fewest bytes per step wins (a
    difference the model cannot resolve is no reason to take on transfers). 0: the fastest."""
    runner_ups: int = 3
    """How many runner-up plans ``explain()`` lists."""
    grad_accumulation_steps: int = 1
    """Micro-batches per optimizer step (set by the framework adapter from the training
    config). Above 1, offloaded chunks need an fp32 gradient accumulator on the host and the
    search minimises the time of a whole optimizer step."""
    data_parallel_size: int = 1
    """Data-parallel ranks (set by the adapter from the launch). Offloaded chunks are sharded:
    each rank keeps 1/world of their host states and gathers the rest over the network."""
    model_states_fixed: int | None = None
    """Device bytes of model states a framework keeps itself (Megatron's parameters, gradients
    and optimizer): the search then chooses only the block activation modes, with no chunks.
    Set by the Megatron adapter."""
    cpu_optim_speculative: bool = False
    """CPU Adam may update offloaded chunks during backward *speculatively* (gradient clipping
    or fp16 loss scaling on; set by the adapter): each speculating chunk first backs up its
    master, exp_avg and exp_avg_sq (12 host bytes per parameter, and a copy's time), and the
    update is redone after backward if the step clips or overflows. The search ranks plans
    with CPU Adam after backward (``cpu_optim_overlap`` false); the chosen plan then gets the
    number of speculating chunks that makes its step fastest within the host memory left."""
    speculate_chunks: int | None = None
    """Pin for the number of offloaded chunks that update speculatively (the last ones in
    execution order; more than there are means all). None: the planner chooses."""
    gradient_clipping: bool = False
    """Gradients are clipped by their global norm (set by the adapter). In 16-bit training
    each offloaded parameter's norm is then taken on the device in fp32 as its chunk's
    gradients leave: a copy of one parameter's gradient the memory model adds to the peak."""
    cpu_optim_overlap: bool = True
    """Whether CPU Adam may update a chunk as soon as its gradient is on the host, overlapping
    the rest of backward (set by the adapter). Gradient clipping and fp16 loss scaling need
    every gradient first (the global norm, the overflow check), so then CPU Adam runs after
    backward."""

    # ---- strict construction from user dicts -------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, where: str = "protrain") -> "PlannerConfig":
        """Build from a user dict (a JSON section, parsed flags). ``where`` prefixes key names
        in errors, e.g. ``protrain.device_memory``. Knob pins may be given at top level or
        under ``pins``."""
        data = dict(data or {})
        allowed = {f.name for f in dataclasses.fields(cls)} | set(KNOB_NAMES)
        for key in data:
            if key not in allowed:
                raise ConfigError(_unknown_key(f"{where}.{key}", key, allowed))
        pins_data = data.pop("pins", None) or {}
        if not isinstance(pins_data, Mapping):
            raise ConfigError(f"{where}.pins = {pins_data!r}: must be a mapping of knob to value, "
                              f"e.g. {{\"n_checkpoint\": 4, \"chunk_size\": \"64MiB\"}}")
        pins_data = dict(pins_data)
        for k in KNOB_NAMES:
            if k in data:
                if k in pins_data:
                    raise ConfigError(f"{where}.{k} is given twice (top level and under pins); keep one")
                pins_data[k] = data.pop(k)
        kwargs: dict[str, Any] = {"pins": _pins_from_dict(pins_data, f"{where}")}
        for key in ("device_memory", "host_memory"):
            if data.get(key) is not None:
                kwargs[key] = _size(data[key], f"{where}.{key}", positive=True)
        for key in ("host_reserve", "memory_margin", "time_tolerance"):
            if key in data:
                v = data[key]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                    raise ConfigError(f"{where}.{key} = {v!r}: must be a fraction in [0, 1), e.g. 0.1")
                kwargs[key] = float(v)
        if "chunk_sizes" in data:
            v = data["chunk_sizes"]
            if not isinstance(v, (list, tuple)) or not v:
                raise ConfigError(f"{where}.chunk_sizes = {v!r}: must be a non-empty list of sizes, "
                                  f"e.g. [\"32MiB\", \"64MiB\"]")
            kwargs["chunk_sizes"] = tuple(_size(x, f"{where}.chunk_sizes", positive=True) for x in v)
        for key in ("grad_accumulation_steps", "data_parallel_size"):
            if key in data:
                v = data[key]
                if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_COUNT:
                    raise ConfigError(f"{where}.{key} = {v!r}: must be a whole number from 1 to {MAX_COUNT}")
                kwargs[key] = v
        for key in ("cpu_optim_overlap", "cpu_optim_speculative", "gradient_clipping"):
            if key in data:
                if not isinstance(data[key], bool):
                    raise ConfigError(f"{where}.{key} = {data[key]!r}: must be true or false")
                kwargs[key] = data[key]
        if data.get("speculate_chunks") not in (None, "auto"):
            v = data["speculate_chunks"]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
                raise ConfigError(f"{where}.speculate_chunks = {v!r}: must be a whole number from 0 "
                                  f"to {MAX_COUNT}, or \"auto\" to let the planner choose")
            kwargs["speculate_chunks"] = v
        if "runner_ups" in data:
            v = data["runner_ups"]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
                raise ConfigError(f"{where}.runner_ups = {v!r}: must be a whole number from 0 to {MAX_COUNT}")
            kwargs["runner_ups"] = v
        return cls(**kwargs)


def _pins_from_dict(data: Mapping[str, Any], where: str) -> KnobPins:
    for key in data:
        if key not in KNOB_NAMES:
            raise ConfigError(_unknown_key(f"{where}.pins.{key}", key, set(KNOB_NAMES)))
    kwargs: dict[str, Any] = {}
    for key, v in data.items():
        if v is None or v == "auto":
            continue
        if key == "chunk_size":
            kwargs[key] = _size(v, f"{where}.{key}", positive=True)
        elif key == "sequence_parallel":
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_COUNT:
                raise ConfigError(f"{where}.{key} = {v!r}: must be a whole number >= 1 (1 turns "
                                  f"sequence parallelism off), or \"auto\" to let the planner choose")
            kwargs[key] = v
        elif key == "n_persist" and v == ALL:
            kwargs[key] = ALL
        elif key == "ckpt_input":
            from .block_mode import CKPT_INPUTS
            if v not in CKPT_INPUTS:
                raise ConfigError(f"{where}.{key} = {v!r}: must be \"device\" (the checkpointed blocks "
                                  f"keep their inputs on the device), \"host\" (in pinned host memory), "
                                  f"\"drive\" (on the NVMe path, ssd_path) or \"auto\" to let the "
                                  f"planner choose")
            kwargs[key] = v
        else:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
                also = ', "all" (every chunk on the device)' if key == "n_persist" else ""
                raise ConfigError(f"{where}.{key} = {v!r}: must be a whole number from 0 to "
                                  f"{MAX_COUNT}{also}, or \"auto\" to let the search choose")
            kwargs[key] = v
    return KnobPins(**kwargs)


def _size(value: Any, key: str, *, positive: bool) -> int:
    try:
        n = parse_bytes(value, what=key)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if positive and n <= 0:
        raise ConfigError(f"{key} = {value!r}: must be positive")
    return n


def _unknown_key(path: str, key: str, allowed: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(allowed), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {path}{hint}. Valid keys: {', '.join(sorted(allowed))}"

"""The "ProTrain" argument group of Megatron-LM and what it means.

``--protrain-auto-memory`` replaces Megatron's activation-memory flags: the plan decides, per
layer, what is kept, recomputed, swapped to host memory or written to NVMe. The flags it
replaces are reported (not silently dropped) when the user also set them.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from protrain.units import parse_bytes

FLAG = "--protrain-auto-memory"

PIN_KNOBS = ("n_checkpoint", "n_swap", "n_ssd", "n_selective")
"""The activation knobs ``--protrain-pin`` may fix (the context-parallel degree is pinned with
Megatron's own ``--context-parallel-size``)."""

REPLACED = (
    ("recompute_granularity", None, "--recompute-granularity / --recompute-activations"),
    ("recompute_method", None, "--recompute-method"),
    ("recompute_num_layers", None, "--recompute-num-layers"),
    ("cpu_offloading", False, "--cpu-offloading"),
    ("cpu_offloading_num_layers", 0, "--cpu-offloading-num-layers"),
)
"""(args attribute, value that means "not set", flag) of what the plan decides instead."""


def add_protrain_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    if any(FLAG in a.option_strings for a in parser._actions):
        return parser                     # added already (parse_args called twice)
    g = parser.add_argument_group("ProTrain", "automatic per-layer activation memory plan "
                                  "(replaces the recompute and CPU-offloading flags)")
    g.add_argument(FLAG, action="store_true",
                   help="profile the model, plan per-layer keep / recompute / swap / NVMe, apply it")
    g.add_argument("--protrain-device-memory", default=None, metavar="SIZE",
                   help="device memory the plan may use per rank, e.g. 70GiB (default: the GPU's)")
    g.add_argument("--protrain-host-memory", default=None, metavar="SIZE",
                   help="the node's host memory for swapped activations, shared by its ranks: "
                        "each plans for 1/ranks-per-node of it (default: what is free)")
    g.add_argument("--protrain-memory-margin", type=float, default=0.10, metavar="FRACTION",
                   help="headroom kept above the predicted peak (default 0.10)")
    g.add_argument("--protrain-ssd-path", default=None, metavar="DIR",
                   help="NVMe directory for activations (enables the SSD mode)")
    g.add_argument("--protrain-plan-file", default=None, metavar="FILE",
                   help="load the plan from FILE if it exists, else save the chosen plan there")
    g.add_argument("--protrain-pin", action="append", default=[], metavar="KNOB=N",
                   help="fix a knob: n_checkpoint, n_swap, n_ssd or n_selective (repeatable)")
    return parser


@dataclass(frozen=True, slots=True)
class MegatronOptions:
    """The ProTrain group's values, checked."""

    device_memory: int | None = None
    """Device bytes per rank the plan may use; None: the device's capacity."""
    host_memory: int | None = None
    """Host bytes per rank for swapped activations; None: what the machine has free."""
    memory_margin: float = 0.10
    """Headroom above the predicted peak (allocator fragmentation, framework buffers)."""
    ssd_path: str | None = None
    """Directory on NVMe for the SSD mode; None disables it."""
    plan_file: str | None = None
    """Saved plan to load (skips profiling and search), or where to save the chosen one."""
    pins: tuple[tuple[str, int], ...] = ()
    """(knob, value) pairs the search must keep."""

    @classmethod
    def from_args(cls, args) -> "MegatronOptions":
        def size(attr):
            v = getattr(args, attr)
            if v is None:
                return None
            try:
                return parse_bytes(v, what="--" + attr.replace("_", "-"))
            except ValueError as e:
                raise SystemExit(f"protrain: {e}") from None
        margin = args.protrain_memory_margin
        if not 0 <= margin < 1:
            raise SystemExit(f"protrain: --protrain-memory-margin {margin} must be in [0, 1), e.g. 0.1")
        pins = []
        for item in args.protrain_pin:
            knob, sep, value = item.partition("=")
            if not sep or knob not in PIN_KNOBS or not value.isdigit():
                raise SystemExit(f"protrain: --protrain-pin {item!r}: use KNOB=N with KNOB one of "
                                 f"{', '.join(PIN_KNOBS)}, e.g. --protrain-pin n_swap=0")
            pins.append((knob, int(value)))
        return cls(device_memory=size("protrain_device_memory"), host_memory=size("protrain_host_memory"),
                   memory_margin=margin, ssd_path=args.protrain_ssd_path,
                   plan_file=args.protrain_plan_file, pins=tuple(pins))


def take_over_flags(args) -> list[str]:
    """Reset the flags the plan replaces (so the model is built without them) and return the
    ones the user had set, as ``--flag value``."""
    overridden = []
    for attr, unset, flag in REPLACED:
        value = getattr(args, attr, unset)
        if value != unset and value is not None:
            overridden.append(f"{flag} {value}" if value is not True else flag)
            setattr(args, attr, unset)
    return overridden

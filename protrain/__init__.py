"""ProTrain: automatic memory management for DeepSpeed and Megatron.

measure -> predict -> choose -> run: ``profile_model`` / ``probe_hardware`` measure the model
and the machine, the cost models in ``protrain.cost`` predict iteration time and peak memory,
``search`` picks the fastest plan that fits, and the runtime executes the ``Plan``.

Importing ``protrain`` is cheap (no torch): the planner core needs only numpy, so
``protrain plan`` runs on any laptop. Names that need torch are imported on first use.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "BlockMode": "protrain.block_mode",
    "PlannerConfig": "protrain.config",
    "KnobPins": "protrain.config",
    "ConfigError": "protrain.config",
    "Plan": "protrain.plan",
    "Knobs": "protrain.plan",
    "search": "protrain.search",
    "evaluate": "protrain.search",
    "InfeasibleError": "protrain.search",
    "ModelProfile": "protrain.profile.model_profile",
    "HardwareProfile": "protrain.profile.hardware",
    "profile_model": "protrain.measure.profiler",
    "probe_hardware": "protrain.measure.probe",
    "find_blocks": "protrain.profile.blocks",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'protrain' has no attribute {name!r}")

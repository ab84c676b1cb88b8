"""The optional frameworks: each adapter names the extra that installs what it needs.

``pip install protrain`` installs the planner (torch, numpy, tqdm); the DeepSpeed engine and the
Megatron hooks need their framework, which a user usually has already, at a version the
adapter is checked against (setup.py's extras; docs/compatibility.md).
"""
from __future__ import annotations

import importlib.util

EXTRAS = {
    "deepspeed": ("deepspeed", "protrain_ds (ProTrain's DeepSpeed engine)"),
    "megatron": ("megatron.core", "protrain_megatron (ProTrain's Megatron hooks)"),
}
"""extra -> (the module it provides, who needs it)."""


def require(extra: str) -> None:
    """Raise ModuleNotFoundError naming the extra to install when its framework is missing."""
    module, who = EXTRAS[extra]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:            # the parent package (megatron) is missing
        found = False
    if not found:
        raise ModuleNotFoundError(
            f"{who} needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'protrain[{extra}]' (or install {module.split('.')[0]} at a version "
            f"docs/compatibility.md lists)", name=module)

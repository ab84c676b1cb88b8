"""Entry points of the start-up hook: change nothing unless the flag is on the command line
(imported only when Megatron-LM's training modules are, so it costs nothing otherwise)."""
from __future__ import annotations

import sys

from .arguments import FLAG


def _wanted() -> bool:
    return FLAG in sys.argv


def install_arguments(module) -> None:
    if _wanted():
        from .training import install_arguments as install
        install(module)


def install_training(module) -> None:
    if _wanted():
        from .training import install_training as install
        install(module)

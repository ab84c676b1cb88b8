"""ProTrain for DeepSpeed: add ``"protrain": {"enabled": true}`` to a DeepSpeed config.

With the package installed, ``deepspeed.initialize`` is wrapped at import time (see
protrain/_autoload.py), so existing scripts need no change; ``protrain_ds.initialize`` is the
same function for explicit use.
"""
from .config import ProTrainDSConfig
from .initialize import initialize

__all__ = ["initialize", "ProTrainDSConfig"]

"""ProTrain for DeepSpeed: add ``"protrain": {"enabled": true}`` to a DeepSpeed config.

With the package installed, ``deepspeed.initialize`` is wrapped at import time (see
protrain/_autoload.py), so existing scripts need no change; ``protrain_ds.initialize`` is the
same function for explicit use.
"""
from protrain.requires import require

require("deepspeed")    # before anything imports it: name the extra that installs it

from .config import ProTrainDSConfig  # noqa: E402
from .initialize import initialize  # noqa: E402

__all__ = ["initialize", "ProTrainDSConfig"]

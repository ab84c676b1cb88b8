"""What the fork server of tests/ranks.py loads once for every rank it forks: torch with
torch._dynamo (the first torch optimizer imports it: about 4 s), DeepSpeed with the CPU ops its
engines load on first use (each load runs compiler probes in subprocesses: about 2.5 s), and
megatron-core where installed (about 6 s). Loading runs no tensor work: no thread pool exists
yet to be copied into a forked rank."""
import torch  # noqa: F401
import torch._dynamo  # noqa: F401

import deepspeed  # noqa: F401
from deepspeed.accelerator import get_accelerator

from protrain.native import cpu_info_once  # noqa: E402

for name in ("FusedAdamBuilder", "CPUAdamBuilder", "ShareMemCommBuilder"):
    try:
        with cpu_info_once():          # the compiler probes' CPU query, once for the three
            get_accelerator().create_op_builder(name).load(verbose=False)
    except Exception:  # noqa: BLE001 - a rank that needs it loads it itself (and says why not)
        pass

import warnings  # noqa: E402

with warnings.catch_warnings():       # "Transformer Engine and Apex are not installed", once per
    warnings.simplefilter("ignore")   # import, in whichever test happened to start the server
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        pass

"""Models built under ``deepspeed.zero.Init``: their parameters made whole again.

With a ZeRO-3 JSON, transformers builds every model under ``zero.Init`` (``from_pretrained``
after ``TrainingArguments`` has read the JSON: run_clm and most example scripts), and so do
scripts written for ZeRO-3. Each parameter then holds only this rank's partition
(``ds_tensor``); its ``.data`` is empty, and ZeRO-3's bookkeeping (``ds_id``, ``ds_status``,
``all_gather``, ``partition``, ...) is attached to it.

ProTrain places parameters itself, in its chunks, so it needs them whole. ``unpartition``
gathers every partitioned parameter, one at a time (a model that needs ProTrain may not fit on
the device whole), into a full tensor on the host, and takes ZeRO-3's bookkeeping off: the same
Parameter objects (an optimizer built on them still holds them), with the values the model had.
It is a collective: every rank calls it, in the model's parameter order, as every rank calls
``deepspeed.initialize``.
"""
from __future__ import annotations

from torch import nn

ZERO3_ATTRIBUTES = (
    "aligned_size", "all_gather", "all_gather_coalesced", "convert_to_zero_parameters",
    "is_external_param", "item", "nvme_swapper", "padding_size", "partition",
    "partition_gradients", "partition_numel", "reduce_gradients_at_owner")
"""What ``zero.Init`` sets on a parameter besides its ``ds_*`` attributes
(``Init._convert_to_deepspeed_param``, DeepSpeed 0.19): methods bound to the parameter, and
``item``, which would gather it on every call."""


def is_partitioned(p: nn.Parameter) -> bool:
    return hasattr(p, "ds_id")


def partitioned(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` that ``zero.Init`` partitioned (each once)."""
    return [p for p in model.parameters() if is_partitioned(p)]


def unpartition(model: nn.Module) -> int:
    """Make every ``zero.Init``-partitioned parameter of ``model`` a plain, whole tensor on the
    host; returns how many there were. Collective (see the module's docstring)."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    params = partitioned(model)
    for p in params:
        # modifier_rank=None: read only; the context partitions it again on exit, which frees
        # the gathered copy on the device before the next one is gathered.
        with GatheredParameters([p], modifier_rank=None):
            whole = p.data.detach().to("cpu", copy=True)
        for name in [k for k in vars(p) if k.startswith("ds_") or k in ZERO3_ATTRIBUTES]:
            delattr(p, name)
        p.data = whole
    return len(params)


def check_plain(model: nn.Module) -> None:
    """Refuse a model whose parameters were partitioned after ``deepspeed.initialize`` (the
    only ``zero.Init`` ProTrain cannot undo for the user: it happened behind the engine)."""
    from protrain.config import ConfigError
    if any(is_partitioned(p) for p in model.parameters()):
        raise ConfigError(
            "the model's parameters were partitioned by ZeRO-3 (zero.Init) after "
            "deepspeed.initialize: ProTrain places parameters itself. Build the model before "
            "deepspeed.initialize (a model built under zero.Init before it is made whole there)")

"""Finding the pieces of a megatron-core model the plan acts on."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def unwrap(model: nn.Module | Sequence[nn.Module]) -> nn.Module:
    """The megatron-core model inside Megatron-LM's wrappers (DDP, Float16Module) and lists
    (one entry per virtual pipeline stage; only one stage is supported)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"protrain: {len(model)} model chunks (virtual pipeline parallelism) are "
                             f"not supported; drop --num-layers-per-virtual-pipeline-stage")
        model = model[0]
    seen = 0
    while not hasattr(model, "decoder") and hasattr(model, "module") and seen < 8:
        model = model.module
        seen += 1
    if not hasattr(model, "decoder") or not hasattr(model.decoder, "layers"):
        raise ValueError(f"protrain: {type(model).__name__} has no decoder.layers; per-layer "
                         f"activation plans need a megatron-core GPTModel-style model "
                         f"(TransformerBlock decoder)")
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer layers this rank runs (its pipeline stage), in order."""
    return list(unwrap(model).decoder.layers)


def global_layer_numbers(layers: Sequence[nn.Module]) -> list[int]:
    """Megatron's 1-based global layer numbers (pipeline stages offset them)."""
    return [int(getattr(layer, "layer_number", i + 1)) for i, layer in enumerate(layers)]


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def parallel_sizes() -> dict[str, int]:
    """Tensor / pipeline / data / context parallel sizes of this process, its pipeline stage
    and data-parallel rank (1 and 0 without Megatron's parallel state)."""
    try:
        from megatron.core import parallel_state as ps
        if not ps.model_parallel_is_initialized():
            raise RuntimeError
        return {"tp": ps.get_tensor_model_parallel_world_size(),
                "pp": ps.get_pipeline_model_parallel_world_size(),
                "dp": ps.get_data_parallel_world_size(),
                "cp": ps.get_context_parallel_world_size(),
                "pp_rank": ps.get_pipeline_model_parallel_rank(),
                "dp_rank": ps.get_data_parallel_rank()}
    except Exception:  # noqa: BLE001 - no parallel state: a single process
        return {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "pp_rank": 0, "dp_rank": 0}

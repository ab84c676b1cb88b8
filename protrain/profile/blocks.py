"""Find a model's transformer blocks: the repeated children of its layer list."""
from __future__ import annotations

from torch import nn

# Where well-known model families keep their blocks (Hugging Face GPT-2 / LLaMA / many others,
# Megatron GPTModel, nanoGPT); looked at first, then any other homogeneous ModuleList.
KNOWN_BLOCK_LISTS = ("transformer.h", "model.layers", "decoder.layers", "model.decoder.layers",
                     "transformer.layers", "gpt_neox.layers", "layers", "blocks", "h")


def find_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """Return (qualified name of the block list, its blocks).

    The block list is a ModuleList (or Sequential) of at least two children of one class. A
    well-known name wins; otherwise the candidate holding the most parameters. Wrappers such as
    DeepSpeed's engine or DDP (``module.``) are looked through.
    """
    candidates: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
            kinds = {type(c) for c in mod}
            if len(kinds) == 1 and sum(1 for _ in mod[0].parameters()) > 0:
                candidates.append((name, mod))
    if not candidates:
        raise ValueError(
            f"could not find the transformer blocks of {type(model).__name__}: no ModuleList of "
            f"two or more identical, parameterised children. Pass the blocks explicitly "
            f"(profile_model(..., blocks=model.my_layers))")
    for known in KNOWN_BLOCK_LISTS:
        for name, mod in candidates:
            if name == known or name.endswith("." + known):
                return name, list(mod)
    name, mod = max(candidates, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    return name, list(mod)

"""Find a model's blocks: the units the plan gives a mode each and the runtime's part
boundaries cut the iteration at.

In order of preference: the list the user names (``path``: the DeepSpeed section's
``blocks`` key), the repeated children of a transformer's layer list, and for a model without
one (an MLP, a CNN, DeepSpeed's unit-test ``SimpleModel``, ALBERT's single shared layer
group) its top-level modules that hold parameters. The blocks must run in the list's order,
each position once per forward (a module listed several times once per listing; a block called
again right after itself stays in its part): the part boundaries check that as they go
(runtime.boundaries.PartBoundaries).
"""
from __future__ import annotations

from torch import nn

# Where well-known model families keep their blocks (Hugging Face GPT-2 / LLaMA / many others,
# Megatron GPTModel, nanoGPT); looked at first, then any other homogeneous ModuleList.
KNOWN_BLOCK_LISTS = ("transformer.h", "model.layers", "decoder.layers", "model.decoder.layers",
                     "transformer.layers", "gpt_neox.layers", "layers", "blocks", "h")

TOP_LEVEL = "top-level modules"
"""How the block list of a model without a list of repeated blocks is named in messages."""


class BlockListError(ValueError):
    """A named block list that does not exist or holds no blocks; the message names the
    setting, the value and the lists that would work."""


def find_blocks(model: nn.Module, path: str | None = None, *,
                key: str = "protrain.blocks") -> tuple[str, list[nn.Module]]:
    """Return (name of the block list, its blocks).

    ``path``: the qualified name of a ModuleList (or Sequential) whose children are the blocks,
    in the order they run; refused (BlockListError, naming ``key``) where there is none.
    Without it: a ModuleList (or Sequential) of at least two children of one class - a
    well-known name wins, otherwise the candidate holding the most parameters; failing that,
    the model's top-level modules that hold parameters (``top_level_blocks``). Wrappers such
    as DeepSpeed's engine or DDP (``module.``) are looked through.
    """
    if path is not None:
        return path, named_blocks(model, path, key)
    candidates: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
            kinds = {type(c) for c in mod}
            if len(kinds) == 1 and sum(1 for _ in mod[0].parameters()) > 0:
                candidates.append((name, mod))
    if not candidates:
        named = top_level_blocks(model)
        if not named:
            raise ValueError(f"{type(model).__name__} has no module holding parameters to plan")
        return f"{TOP_LEVEL} {', '.join(n for n, _ in named)}", [m for _, m in named]
    for known in KNOWN_BLOCK_LISTS:
        for name, mod in candidates:
            if name == known or name.endswith("." + known):
                return name, list(mod)
    name, mod = max(candidates, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    return name, list(mod)


def top_level_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's children that hold parameters, in declaration order, containers
    (ModuleList, ModuleDict) opened into their members; while only one child holds parameters
    (a wrapper, an ``nn.Sequential`` inside the model), its children instead. Each becomes
    one block: the plan's modes and chunk boundaries then fall between them."""
    prefix, module = "", model
    while True:
        named = _holding_params(prefix, module)
        if len(named) != 1 or not any(_has_params(c) for c in named[0][1].children()):
            return named
        prefix, module = named[0][0] + ".", named[0][1]


def named_blocks(model: nn.Module, path: str, key: str = "protrain.blocks") -> list[nn.Module]:
    """The children of the list at ``path`` (a ModuleList or Sequential with at least one
    child), or a BlockListError naming ``key``, the value and the lists the model has."""
    try:
        mod = model.get_submodule(path) if path else None
    except AttributeError:
        mod = None
    if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 0:
        return list(mod)
    what = ("names no module" if mod is None else
            f"is an empty {type(mod).__name__}" if isinstance(mod, (nn.ModuleList, nn.Sequential))
            else f"is a {type(mod).__name__}, not a ModuleList or Sequential of blocks")
    lists = block_lists(model)
    have = (f"the lists of {type(model).__name__} that hold parameters: " + ", ".join(
        f"{n!r} ({len(m)} x {_kinds(m)})" for n, m in lists)) if lists else \
        f"{type(model).__name__} has no ModuleList or Sequential holding parameters"
    raise BlockListError(f"{key} = {path!r} {what} in {type(model).__name__}; {have}. Name one of "
                         f"them, or remove the setting to let ProTrain find the blocks")


def block_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every ModuleList / Sequential of ``model`` with a child holding parameters: the values
    ``named_blocks`` takes."""
    return [(n, m) for n, m in model.named_modules() if n and isinstance(m, (nn.ModuleList, nn.Sequential))
            and any(_has_params(c) for c in m)]


def _holding_params(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    out = []
    for name, child in module.named_children():
        if not _has_params(child):
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):    # no forward of their own
            out += _holding_params(f"{prefix}{name}.", child)
        else:
            out.append((f"{prefix}{name}", child))
    return out


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _kinds(mod: nn.Module) -> str:
    kinds = list(dict.fromkeys(type(c).__name__ for c in mod))
    return kinds[0] if len(kinds) == 1 else "/".join(kinds[:3]) + ("/..." if len(kinds) > 3 else "")

"""ProfileCache: measured model profiles kept between runs, keyed by what the profiler measures.

A cached profile is reused without running the model, so its key must change whenever the
traced iteration would measure something else. It covers:

- the model's code: the source file of every module class that is not torch's own (a
  ``forward`` edited to keep more activations, a helper function in the same file), or the
  compiled methods of a class without a source file (defined in a notebook);
- the model's settings: each module's plain attributes (dropout p, eps, head counts, flags
  such as ``training``), a Hugging Face ``config`` or a dataclass config, buffers, parameter
  names, shapes, dtypes and which are trainable, and the names of each module registered
  under several (shared layers);
- the batch: every tensor input's shape and dtype, and the plain (scalar) keyword inputs;
- the device, torch, and the profiler's own code.

Not covered: code outside those files that ``forward`` calls (another module of the user's,
a library other than torch) - clear the cache directory after changing such code.

An unusable cache directory is reported once and then ignored: profiling again is always
correct, only slower.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
from pathlib import Path

import torch
from torch import nn

from ..serde import unwritable
from .model_profile import ModelProfile

log = logging.getLogger("protrain")

# The profiler's own code, relative to the protrain package: what it measures changes with it.
_PROFILER_FILES = ("measure/profiler.py", "measure/attention.py", "runtime/meter.py",
                   "profile/model_profile.py", "profile/blocks.py", "profile/cache.py",
                   "runtime/tiled_head.py")
_PACKAGE = Path(__file__).parent.parent
_SCALARS = (bool, int, float, str, type(None))


class ProfileCache:
    def __init__(self, directory: str | Path | None, *, key_name: str = "profile_cache_dir"):
        """``directory`` None disables the cache. It is created if missing; if files cannot be
        written there the cache is disabled with a warning naming ``key_name``."""
        self.directory = Path(directory) if directory else None
        if self.directory is not None:
            why = unwritable(self.directory)
            if why is not None:
                log.warning("protrain: %s %s cannot be used (%s); profiles will not be cached",
                            key_name, self.directory, why)
                self.directory = None
        self.key_name = key_name

    def path(self, module: nn.Module, inputs, kwargs, device: torch.device,
             length: int | None = None, blocks=None, head_tiling: bool = False,
             mlp_tiling: bool = False) -> Path | None:
        """Where the profile of ``module`` on this batch lives (``length``: the profiled prefix
        of the sequence, when shorter than the batch's; ``blocks``: the modules profiled as
        blocks, when given)."""
        if self.directory is None:
            return None
        key = cache_key(module, inputs, kwargs, device, length, blocks, head_tiling, mlp_tiling)
        return self.directory / f"profile-{key}.json"

    def load(self, path: Path | None) -> ModelProfile | None:
        if path is None or not path.exists():
            return None
        try:
            return ModelProfile.load(path)
        except (OSError, ValueError, KeyError, TypeError):
            return None         # damaged or from another version: measure again

    def save(self, path: Path | None, profile: ModelProfile) -> None:
        if path is None:
            return
        try:
            profile.save(path)
        except OSError as e:
            log.warning("protrain: cannot write the profile cache %s (%s); it will be measured "
                        "again next time", path, e)


def cache_key(module: nn.Module, inputs, kwargs, device: torch.device,
              length: int | None = None, blocks=None, head_tiling: bool = False,
              mlp_tiling: bool = False) -> str:
    names = {m: n for n, m in module.named_modules()}
    ident = {
        "profiled_length": length,
        "head_tiling": head_tiling,
        "mlp_tiling": mlp_tiling,
        "blocks": None if blocks is None else [names.get(b, "?") for b in blocks],
        "model": f"{type(module).__module__}.{type(module).__qualname__}",
        "code": _code_fingerprint(module),
        "settings": [(name, _settings(m)) for name, m in module.named_modules()],
        "shared": _shared_modules(module),
        "params": [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()],
        "buffers": [(n, list(b.shape), str(b.dtype)) for n, b in module.named_buffers()],
        "inputs": [(k, list(t.shape), str(t.dtype)) for k, t in
                   list(enumerate(inputs)) + list(kwargs.items()) if isinstance(t, torch.Tensor)],
        "options": [(k, v) for k, v in kwargs.items() if isinstance(v, _SCALARS)],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "profiler": _file_hashes([_PACKAGE / f for f in _PROFILER_FILES]),
    }
    # Insertion order is deterministic (code order); sorting could fail on mixed key types.
    return hashlib.sha256(json.dumps(ident, default=str).encode()).hexdigest()[:16]


def _shared_modules(module: nn.Module) -> list[list[str]]:
    """Every name of each module registered under several (weights shared across layers):
    ``[a, b, a, b]`` and ``[a, b, b, a]`` have the same modules and parameters, not the same
    parts using them."""
    names: dict[int, list[str]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def _code_fingerprint(module: nn.Module) -> str:
    """Hash of the code of every module class in ``module`` that is not torch's own."""
    files, loose = set(), []
    for cls in {c for m in module.modules() for c in type(m).__mro__}:
        if cls.__module__.split(".")[0] in ("torch", "builtins"):
            continue
        try:
            files.add(Path(inspect.getsourcefile(cls)))
        except (TypeError, OSError):
            # No source file (defined interactively): its methods' compiled code instead.
            loose.append((cls.__qualname__, [_code_text(f.__code__) for f in
                                             vars(cls).values() if inspect.isfunction(f)]))
    return _file_hashes(sorted(files)) + hashlib.sha256(repr(sorted(loose)).encode()).hexdigest()


def _code_text(code) -> str:
    """A compiled function's bytecode, names and constants (nested functions included);
    stable across processes, unlike marshal's output."""
    consts = [_code_text(c) if inspect.iscode(c) else repr(c) for c in code.co_consts]
    return f"{code.co_code.hex()}|{code.co_names}|{consts}"


def _file_hashes(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(str(p).encode())
        try:
            h.update(p.read_bytes())
        except OSError:
            h.update(b"<unreadable>")
    return h.hexdigest()


def _settings(m: nn.Module) -> dict:
    """A module's plain attributes and its config object, the values that shape its forward."""
    out = {k: v for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, _SCALARS)}
    out.update({k: list(v) for k, v in vars(m).items() if not k.startswith("_") and
                isinstance(v, tuple) and all(isinstance(x, _SCALARS) for x in v)})
    config = getattr(m, "config", None)
    if hasattr(config, "to_dict"):
        out["config"] = config.to_dict()
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        out["config"] = dataclasses.asdict(config)
    return out

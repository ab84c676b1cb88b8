"""Start-up hook, run from protrain-autoload.pth in site-packages at every interpreter start.

It must cost nothing and never fail: it only registers a post-import hook, so that when
``deepspeed`` is imported (by a user script, Hugging Face, accelerate) its ``initialize`` is
wrapped by ``protrain_ds.initialize``. Without ``"protrain": {"enabled": true}`` in the config
the wrapper calls DeepSpeed's own initialize untouched. Likewise Megatron-LM's argument parser
and ``get_model`` are wrapped when ``--protrain-auto-memory`` is on the command line.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_HOOKS = {
    "deepspeed": ("protrain_ds.initialize", "install"),
    # Megatron-LM (source tree, not on PyPI): only when --protrain-auto-memory is on the
    # command line; the hook functions check it and otherwise change nothing.
    "megatron.training.arguments": ("protrain_megatron.autoload", "install_arguments"),
    "megatron.training.training": ("protrain_megatron.autoload", "install_training"),
}


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self._busy: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _HOOKS or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_hook(module, _exec=exec_module, _name=fullname):
            _exec(module)
            _run_hook(_name, module)

        spec.loader.exec_module = exec_and_hook
        return spec


def _run_hook(name: str, module) -> None:
    try:
        mod_name, fn = _HOOKS[name]
        getattr(importlib.import_module(mod_name), fn)(module)
    except Exception as e:  # noqa: BLE001 - never break the user's import
        print(f"protrain: could not hook {name} ({e}); call protrain_ds.initialize explicitly",
              file=sys.stderr)


def install() -> None:
    if any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PostImportFinder())
    for name in _HOOKS:  # already imported before the hook (e.g. installed after start-up)
        if name in sys.modules:
            _run_hook(name, sys.modules[name])


import importlib  # noqa: E402

try:
    install()
except Exception:  # noqa: BLE001
    pass

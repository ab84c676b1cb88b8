"""DeepSpeed's unit tests with the "protrain" section injected (run.sh puts this directory on
PYTHONPATH, so every interpreter - pytest and each rank it spawns - loads this file).

DSUNIT_INJECT=1: every config given to deepspeed.initialize (a dict, a path or base64 string,
config_params, args.deepspeed_config) gets ``"protrain": SECTION`` added. sitecustomize runs
after site-packages' .pth files, so ProTrain's post-import finder is already on sys.meta_path;
ours goes in front of it: on ``import deepspeed`` the module is executed (ProTrain's hook wraps
deepspeed.initialize), then we wrap whatever deepspeed.initialize is at that moment. Every call
appends one line (the test, how the config came, the engine or the exception) to $DSUNIT_LOG.

In both modes (plain and injected), two adaptations of the harness, not of the tests:
- the installed DeepSpeed may be newer than the tests (no tag of the installed version):
  ``DeepSpeedEngine.sparse_tensor_module_names``, which 0.19.8 removed and the checkpoint tests
  compare, is given back as an empty set;
- ``unit.checkpoint.common.compare_model_states`` compares a ProTrain engine's optimizer as it
  compares a client torch optimizer (weights compared, no DeepSpeed fp32 partitions to read):
  it would fail with "Unexpected Optimizer Type" before reaching anything ProTrain does.
"""
import os
import sys

if os.environ.get("DSUNIT_VANILLA") == "1":
    # baseline without ProTrain's start-up hook: drop its post-import finder (installed by
    # protrain-autoload.pth before sitecustomize runs), so deepspeed.initialize stays DeepSpeed's
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_PostImportFinder"]

import importlib
import importlib.abc
import importlib.util

if os.environ.get("DSUNIT_INJECT") == "1":
    SECTION = {"enabled": True, "progress": False, "verbosity": 0, "device_memory": "1GiB"}
    LOG = os.environ.get("DSUNIT_LOG", "injected.log")

    def _log(line):
        try:
            with open(LOG, "a") as f:
                f.write(line + "\n")
        except Exception:
            pass

    def _caller():
        f = sys._getframe(2)
        while f is not None:
            fn = f.f_code.co_filename
            if "/tests/unit/" in fn and not fn.endswith(("common.py", "simple_model.py")):
                return "%s:%s:%d" % (fn.split("/tests/unit/")[1], f.f_code.co_name, f.f_lineno)
            f = f.f_back
        return "?"

    def _inject_dict(d):
        d = dict(d)
        if "protrain" not in d:
            d["protrain"] = dict(SECTION)
        return d

    def _load(path):
        # as DeepSpeed reads a config file (JSON or HJSON)
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
        return load_ds_config(str(path))

    def _inject_cfg(cfg):
        import json
        if isinstance(cfg, dict):
            return _inject_dict(cfg), "dict"
        if isinstance(cfg, (str, os.PathLike)) and os.path.isfile(cfg):
            return _inject_dict(_load(cfg)), "path"
        if isinstance(cfg, str):  # DeepSpeed also takes a base64-encoded JSON string
            try:
                return _inject_dict(_load(cfg)), "base64"
            except Exception:
                pass
        return cfg, "untouched:%s" % type(cfg).__name__

    def _make_wrapper(inner):
        def initialize(*args, **kwargs):
            import inspect
            import json
            import deepspeed as _ds
            sig = inspect.signature(_ds._dsunit_sig_source)
            ba = sig.bind_partial(*args, **kwargs)
            kw = dict(ba.arguments)
            how = []
            if kw.get("config") is not None:
                kw["config"], h = _inject_cfg(kw["config"])
                how.append("config=" + h)
            if kw.get("config_params") is not None:
                kw["config_params"], h = _inject_cfg(kw["config_params"])
                how.append("config_params=" + h)
            a = kw.get("args")
            if a is not None and not how:
                path = getattr(a, "deepspeed_config", None) or getattr(a, "deepscale_config", None)
                if isinstance(path, str) and os.path.isfile(path):
                    d = _inject_dict(_load(path))
                    new = path + ".protrain.%d.json" % os.getpid()
                    with open(new, "w") as f:
                        json.dump(d, f)
                    if getattr(a, "deepspeed_config", None):
                        a.deepspeed_config = new
                    else:
                        a.deepscale_config = new
                    how.append("args.deepspeed_config=path")
            where = _caller()
            tag = ",".join(how) or "NO-CONFIG"
            try:
                out = inner(**kw)
            except BaseException as e:
                _log("%d\t%s\t%s\tEXC %s: %s" % (os.getpid(), where, tag, type(e).__name__,
                                                 str(e).replace("\n", " ")[:300]))
                raise
            eng = out[0] if isinstance(out, tuple) and out else out
            _log("%d\t%s\t%s\tOK %s" % (os.getpid(), where, tag, type(eng).__name__))
            return out
        initialize._dsunit_wrapper = True
        initialize.__wrapped__ = inner
        initialize.__doc__ = getattr(inner, "__doc__", None)
        return initialize

    def _wrap_initialize(module):
        cur = module.initialize
        if getattr(cur, "_dsunit_wrapper", False):
            return
        # signature of DeepSpeed's own initialize, for binding positional args
        module._dsunit_sig_source = getattr(module, "_protrain_original_initialize", None) or cur
        module.initialize = _make_wrapper(cur)
        _log("%d\t-\tHOOK installed over %s (protrain wrapper: %s)"
             % (os.getpid(), getattr(cur, "__module__", "?"), bool(getattr(cur, "_protrain_wrapper", False))))


def _deepspeed_loaded(module):
    """The version gap: an attribute the tests compare that the installed DeepSpeed dropped."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    if not hasattr(DeepSpeedEngine, "sparse_tensor_module_names"):
        DeepSpeedEngine.sparse_tensor_module_names = frozenset()
    if os.environ.get("DSUNIT_INJECT") == "1":
        _wrap_initialize(module)


def _common_loaded(module):
    """compare_model_states: a ProTrain engine's optimizer compared as a client torch one."""
    original = module.compare_model_states

    def compare_model_states(saved_model, loaded_model, compare_optimizer=True, load_module_only=False):
        if type(getattr(saved_model, "optimizer", None)).__name__ == "ProTrainOptimizer":
            compare_optimizer = False
        return original(saved_model, loaded_model, compare_optimizer=compare_optimizer,
                        load_module_only=load_module_only)
    module.compare_model_states = compare_model_states


_HOOKS = {"deepspeed": _deepspeed_loaded, "unit.checkpoint.common": _common_loaded}


class _Finder(importlib.abc.MetaPathFinder):
    """Runs a hook of _HOOKS right after its module is executed."""
    _busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _HOOKS or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        inner_exec = spec.loader.exec_module

        def exec_and_hook(module, _e=inner_exec):
            _e(module)
            _HOOKS[fullname](module)
        spec.loader.exec_module = exec_and_hook
        return spec


for _name, _fn in _HOOKS.items():
    if _name in sys.modules:
        _fn(sys.modules[_name])
sys.meta_path.insert(0, _Finder())

"""Shared test helpers: synthetic profiles with hand-chosen numbers, and the gpu marker."""
from __future__ import annotations

import pytest

from protrain.profile.hardware import HardwareProfile
from protrain.profile.model_profile import ModelProfile, ParamRecord, PartProfile


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "matrix: the rest of issue 25's Hugging Face matrix "
                            "(tests/test_hf_matrix.py) and known failures kept as strict xfails (tests/test_trl.py); "
                            "deselected by default, run with -m matrix")


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _unpatched_linear():
    """``torch.nn.functional.linear`` as torch has it, after every test: DeepSpeed's
    ``zero.Init`` (a ZeRO-3 JSON through transformers) replaces it for the rest of the process
    ("This will persist unless manually reset"), and its backward rounds differently - a later
    test comparing a run against a reference computed before would see ulp differences that
    are not its own. Likewise transformers' global ZeRO-3 switch."""
    import sys

    import torch.nn.functional as F
    linear = F.linear
    yield
    F.linear = linear
    # Likewise transformers' "ZeRO-3 is on" (set by TrainingArguments with a ZeRO-3 JSON, held
    # while anything holds those arguments): a later from_config would build under zero.Init.
    hf = sys.modules.get("transformers.integrations.deepspeed")
    if hf is not None and hasattr(hf, "unset_hf_deepspeed_config"):
        hf.unset_hf_deepspeed_config()


def part(name, kind, *, numel=0, f=0.0, b=0.0, inb=0, saved=0, fs=0, fp=0, bs=0, bp=0):
    return PartProfile(name=name, kind=kind, param_numel=numel, fwd_time=f, bwd_time=b,
                       in_bytes=inb, saved_bytes=saved, fwd_start=fs, fwd_peak=fp,
                       bwd_start=bs, bwd_peak=bp)


def chain_profile(block_params=(100, 100), pre_params=100, post_params=0, *, param_bytes=4,
                  fwd=10.0, bwd=20.0, pre_f=1.0, pre_b=2.0, post_f=1.0, post_b=2.0,
                  saved=0, tied=False) -> ModelProfile:
    """pre, len(block_params) blocks, post; one parameter per part (so with a chunk capacity
    equal to the parameter size, chunk i holds part i's parameter)."""
    n = len(block_params)
    post_idx = n + 1
    params = [ParamRecord("pre.w", pre_params, (0, post_idx) if tied else (0,))]
    params += [ParamRecord(f"h.{i}.w", x, (i + 1,)) for i, x in enumerate(block_params)]
    if post_params:
        params.append(ParamRecord("post.w", post_params, (post_idx,)))
    parts = [part("<pre>", "pre", numel=pre_params, f=pre_f, b=pre_b)]
    parts += [part(f"h.{i}", "block", numel=x, f=fwd, b=bwd, saved=saved)
              for i, x in enumerate(block_params)]
    parts.append(part("<post>", "post", numel=post_params, f=post_f, b=post_b))
    return ModelProfile(name="chain", source="measured", device="cpu", param_bytes=param_bytes,
                        params=tuple(params), parts=tuple(parts))


def slow_link(**over) -> HardwareProfile:
    """400-byte chunks take 5 s each way; CPU Adam does 100 parameters in 4 s, device Adam in 1 s."""
    kw = dict(name="hand", source="measured", device_type="cpu", device_memory=10**9,
              host_memory=10**9, h2d_bandwidth=80.0, d2h_bandwidth=80.0, gpu_adam_rate=100.0,
              cpu_adam_rate=25.0)
    kw.update(over)
    return HardwareProfile(**kw)

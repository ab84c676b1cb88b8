"""The DeepSpeed engine behind "protrain": {"enabled": true}: same training as DeepSpeed."""
import functools
import json

import pytest
import torch

from dstrain import TINY, UNTIED, base_config, train, with_protrain

from protrain.block_mode import BlockMode
from protrain.plan import Plan
from protrain.units import parse_bytes

# Plan shapes, by pins. Chunk sizes in bytes of fp32 parameters: 230 KiB ~ one block of the
# tiny GPT (a block spans two chunks), 4 MiB holds the whole model in one chunk.
SHAPES = {
    "all persistent": (TINY, dict(n_swap=0, n_checkpoint=0, chunk_size="230KiB", n_persist=5)),
    "all offloaded, 1 buffer": (UNTIED, dict(chunk_size="4MiB", n_persist=0, n_buffer=1,
                                             n_swap=0, n_checkpoint=0)),
    "all offloaded, 2 buffers": (UNTIED, dict(chunk_size="230KiB", n_persist=0, n_buffer=2,
                                              n_swap=0, n_checkpoint=0)),
    "mixed chunks": (TINY, dict(chunk_size="230KiB", n_persist=2, n_buffer=2, n_swap=0,
                                n_checkpoint=0)),
    "every block CKPT": (TINY, dict(n_checkpoint=4, n_swap=0, chunk_size="230KiB", n_persist=5)),
    "every block SWAP": (TINY, dict(n_swap=4, n_checkpoint=0, chunk_size="230KiB", n_persist=5)),
    "a mix": (UNTIED, dict(chunk_size="110KiB", n_persist=2, n_buffer=4, n_swap=1, n_checkpoint=2)),
}


@functools.lru_cache(maxsize=None)
def deepspeed_run(model_cfg, extra_json: str, steps: int = 20, loss_factor: float = 1.0):
    return train(base_config(**json.loads(extra_json)), model_cfg, steps, loss_factor=loss_factor)[:2]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp32_training_equals_deepspeed_zero0_exactly(shape):
    model_cfg, pins = SHAPES[shape]
    ref_losses, ref_weights = deepspeed_run(model_cfg, "{}")
    losses, weights, engine = train(with_protrain(base_config(), **pins), model_cfg)
    plan = engine.protrain_plan
    for k, v in pins.items():
        got = getattr(plan.knobs, k)
        assert got == (parse_bytes(v) if k == "chunk_size" else v), k
    assert losses == ref_losses
    for name, w in ref_weights.items():
        assert torch.equal(weights[name], w), name
    assert losses[-1] < losses[0]
    engine.destroy()


def test_gradient_accumulation_clipping_and_scheduler_equal_deepspeed():
    extra = {"gradient_accumulation_steps": 3, "gradient_clipping": 0.05,
             "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    model_cfg, pins = SHAPES["a mix"]
    ref_losses, ref_weights = deepspeed_run(model_cfg, json.dumps(extra), 8)
    losses, weights, engine = train(with_protrain(base_config(**extra), **pins), model_cfg, 8)
    assert losses == ref_losses
    for name, w in ref_weights.items():
        assert torch.equal(weights[name], w), name
    assert engine.global_steps == 8 and engine.get_lr() == [1e-3]
    assert engine.get_global_grad_norm() > 0
    assert engine.protrain_plan.prediction.grad_accumulation_steps == 3


def test_bf16_training_matches_deepspeed_within_bf16_tolerance():
    extra = {"bf16": {"enabled": True}, "gradient_clipping": 1.0}
    pins = dict(chunk_size="55KiB", n_persist=2, n_buffer=4, n_swap=1, n_checkpoint=2)
    ref_losses, ref_weights = deepspeed_run(UNTIED, json.dumps(extra))
    losses, weights, engine = train(with_protrain(base_config(**extra), **pins), UNTIED)
    assert engine.protrain_plan.param_bytes == 2
    # bf16 keeps 8 bits of mantissa: losses within 1%, weights within a few bf16 steps of
    # their size (DeepSpeed's bf16 path itself drifts from fp32 by as much).
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 0.01 * abs(b)
    for name, w in ref_weights.items():
        assert (weights[name] - w).abs().max() <= 0.03, name
    fp32_losses, _ = deepspeed_run(UNTIED, json.dumps({"gradient_clipping": 1.0}))
    assert abs(losses[5] - fp32_losses[5]) < 0.01


def test_runtime_device_bytes_stay_under_the_predicted_peak():
    for shape in ("a mix", "every block SWAP", "all offloaded, 2 buffers"):
        model_cfg, pins = SHAPES[shape]
        _, _, engine = train(with_protrain(base_config(), accounting=True, **pins), model_cfg, 3)
        runtime = engine.protrain_runtime
        predicted = engine.protrain_plan.prediction.peak_device_bytes
        assert 0 < runtime.device_peak() <= predicted, shape
        assert runtime.device_peak() >= 0.9 * predicted, shape   # and the prediction is tight
        engine.destroy()


def test_swap_moves_activations_off_the_device_and_ckpt_recomputes():
    _, _, engine = train(with_protrain(base_config(), **SHAPES["a mix"][1]), UNTIED, 2)
    acts = engine.protrain_runtime.activations
    assert engine.protrain_plan.block_modes[0] == BlockMode.SWAP
    assert acts.stats["swapped_bytes"] > 0 and acts.stats["prefetched_bytes"] == acts.stats["swapped_bytes"]
    assert acts.stats["swap_dedup_hits"] > 0            # views of one storage are copied once
    assert engine.protrain_plan.block_modes.count(BlockMode.CKPT) == 2
    engine.destroy()


def test_plan_file_is_saved_then_loaded_without_profiling(tmp_path, capsys):
    path = tmp_path / "plan.json"
    cfg = with_protrain(base_config(), plan_file=str(path), verbosity=1)
    losses1, _, e1 = train(cfg, TINY, 3)
    assert path.exists() and e1.protrain_profile is not None
    e1.destroy()
    losses2, _, e2 = train(cfg, TINY, 3)
    out = capsys.readouterr().out
    assert "plan loaded from" in out and e2.protrain_profile is None
    assert losses1 == losses2 and e2.protrain_plan.knobs == e1.protrain_plan.knobs
    e2.destroy()


def test_a_plan_file_for_another_run_is_refused_saying_what_changed(tmp_path):
    """The plan's own record (blocks, parameters, dtype) is compared with the run before
    anything is built: a plan made for 2 blocks used to crash a 4-block model with an
    IndexError, one made before a parameter was frozen blamed the optimizer. (A plan made for
    smaller batches is planned again: tests/test_batch_shapes.py.)"""
    import deepspeed
    from protrain.config import ConfigError
    from protrain.models import GPT, GPTConfig, synthetic_batch
    path = tmp_path / "plan.json"
    cfg = with_protrain(base_config(), plan_file=str(path))
    _, _, e = train(cfg, TINY, 1)
    e.destroy()

    def first_step(ds_config, model_cfg=TINY, seq=None, freeze=None):
        torch.manual_seed(0)
        model = GPT(model_cfg)
        if freeze:
            model.get_parameter(freeze).requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=[
            p for p in model.parameters() if p.requires_grad])
        try:
            x, y = synthetic_batch(model_cfg, ds_config["train_micro_batch_size_per_gpu"], seq)
            engine.backward(engine(x, y))
        finally:
            engine.destroy()

    cases = [
        (dict(ds_config=cfg, model_cfg=GPTConfig(**{**vars(TINY), "n_layer": 6})),
         "made for a model with 4 blocks, this one has 6"),
        (dict(ds_config=with_protrain(base_config(bf16={"enabled": True}), plan_file=str(path))),
         "made for 4-byte parameters, this run trains 2-byte ones"),
        (dict(ds_config=cfg, freeze="transformer.h.1.mlp.c_fc.bias"),
         "parameter transformer.h.1.mlp.c_fc.bias is trainable in the plan but frozen in this run"),
        (dict(ds_config=cfg, model_cfg=GPTConfig(**{**vars(TINY), "n_embd": 32})),
         "made for another model (parameter transformer.wte.weight has 16384 elements there, 8192 here)"),
        # a pin the saved plan does not hold used to be ignored without a word
        (dict(ds_config=with_protrain(base_config(), plan_file=str(path), n_checkpoint=3)),
         "made with n_checkpoint=0 and protrain.n_checkpoint pins 3"),
    ]
    # A plan made for fewer blocks (its parameters all exist in the bigger model).
    small = tmp_path / "small.json"
    _, _, e = train(with_protrain(base_config(), plan_file=str(small)),
                    GPTConfig(**{**vars(TINY), "n_layer": 2}), 1)
    e.destroy()
    cases.insert(0, (dict(ds_config=with_protrain(base_config(), plan_file=str(small))),
                     "made for a model with 2 blocks, this one has 4"))
    for kwargs, words in cases:
        with pytest.raises(ConfigError) as err:
            first_step(**kwargs)
        assert words in str(err.value) and "delete it" in str(err.value), str(err.value)
    assert Plan.load(path).micro_batch == 2 and Plan.load(path).seq_len == TINY.block_size


_NET = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return {forward}


class Net(nn.Module):
    def __init__(self, d=64, n=3):
        super().__init__()
        self.h = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x, y):
        for block in self.h:
            x = block(x)
        return ((self.head(x).squeeze(-1) - y) ** 2).mean()
"""


def test_the_profile_cache_sees_a_changed_forward(tmp_path, monkeypatch):
    """Same class, same parameters, a forward that keeps 8x more activations: profiled again,
    not served from the cache (the cache key covers the model's code); unchanged code hits it."""
    import importlib.util
    import sys
    import deepspeed
    cache, src = tmp_path / "cache", tmp_path / "net_under_test.py"
    cfg = with_protrain(base_config(), profile_cache_dir=str(cache))

    def load(forward: str, *, imported: bool = True):
        src.write_text(_NET.format(forward=forward))
        spec = importlib.util.spec_from_file_location("net_under_test", src)
        mod = importlib.util.module_from_spec(spec)
        if imported:            # as an import does: its source file is found and hashed
            monkeypatch.setitem(sys.modules, "net_under_test", mod)
        spec.loader.exec_module(mod)
        return mod

    def run(forward: str):
        mod = load(forward)
        torch.manual_seed(0)
        model = mod.Net()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        x, y = torch.randn(2, 16, 64), torch.randn(2, 16)
        engine.backward(engine(x, y))
        engine.step()
        saved = sum(b.saved_bytes for b in engine.protrain_profile.blocks)
        engine.destroy()
        return saved, sorted(p.name for p in cache.iterdir())

    lean, files = run("torch.tanh(self.fc(x))")
    assert len(files) == 1
    # eight tanh outputs saved per block instead of one
    fat, files = run("sum(torch.tanh(self.fc(x) + i) for i in range(8)) / 8")
    assert fat >= 7 * lean and len(files) == 2, (lean, fat, files)
    again, files = run("torch.tanh(self.fc(x))")
    assert again == lean and len(files) == 2          # the first entry, reused
    # Classes without a findable source file (a notebook): their compiled code is the key.
    from protrain.profile.cache import cache_key
    x, y = torch.randn(2, 16, 64), torch.randn(2, 16)
    keys = [cache_key(load(f, imported=False).Net(), (x, y), {}, torch.device("cpu"))
            for f in ("torch.tanh(self.fc(x))", "torch.tanh(self.fc(x)) * 2", "torch.tanh(self.fc(x))")]
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_train_batch_get_lr_and_torch_style_backward():
    import deepspeed
    from protrain.models import GPT, synthetic_batch
    torch.manual_seed(0)
    model = GPT(TINY)
    cfg = with_protrain(base_config(gradient_accumulation_steps=2))
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=cfg)
    batches = iter([synthetic_batch(TINY, 2, seed=i) for i in range(4)])
    loss = engine.train_batch(batches)
    assert loss.numel() == 1 and engine.global_steps == 1
    x, y = synthetic_batch(TINY, 2, seed=9)
    out = engine(x, y)
    engine.scale(out).backward()          # direct backward, DeepSpeed's supported spelling
    engine.step()
    out = engine(x, y)
    engine.scale(out).backward()
    engine.step()
    assert engine.global_steps == 2 and engine.get_lr() == [1e-3]
    assert optimizer is engine.optimizer
    engine.destroy()

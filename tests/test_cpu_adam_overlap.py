"""CPU Adam on its worker thread next to backward (tests/deferred_streams.py runs it as with a
GPU): updates overlapping backward, a gradient that arrives after its chunk left the device,
and a worker error under gradient accumulation."""
import threading

import pytest
import torch

from deferred_streams import deferred_streams
from dstrain import UNTIED, base_config, train, with_protrain
from test_ds_engine import SHAPES, deepspeed_run

import protrain_ds.engine as engine_mod
from protrain.runtime.optimizer import ChunkOptimizer

NO_CLIP = '{"gradient_clipping": 0.0}'     # DeepSpeed clips at 1.0 by default: no overlap then


def test_updates_overlapping_backward_train_exactly_like_deepspeed(monkeypatch):
    model_cfg, pins = SHAPES["a mix"]
    ref_losses, ref_weights = deepspeed_run(model_cfg, NO_CLIP, 5)
    in_step, outside_step = [False], []
    step, update = ChunkOptimizer.step, ChunkOptimizer._host_update

    def stepping(self):
        in_step[0] = True
        try:
            step(self)
        finally:
            in_step[0] = False

    def updating(self, c, coef):
        outside_step.append(not in_step[0])
        update(self, c, coef)
    monkeypatch.setattr(ChunkOptimizer, "step", stepping)
    monkeypatch.setattr(ChunkOptimizer, "_host_update", updating)
    with deferred_streams(monkeypatch):
        losses, weights, engine = train(with_protrain(base_config(gradient_clipping=0.0), **pins),
                                        model_cfg, 5)
        assert engine.protrain_runtime.optimizer.overlap
        engine.destroy()
    assert any(outside_step)                           # updates ran during backward
    assert losses == ref_losses
    assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())


def test_a_gradient_arriving_after_its_chunk_was_offloaded_is_applied(monkeypatch):
    """After profiling, block 0 also uses block 3's ln_1.bias, whose chunk is offloaded and
    declared done at block 3's backward: its gradient comes late, after block 0's. The first
    step of the plan finds that and defers the chunk's CPU Adam to the end of backward, so
    training stays exactly DeepSpeed's (same model, the extra use from the start)."""
    model_cfg, pins = SHAPES["a mix"]
    use = {"on": False}

    def extra_use(model):
        bias = model.transformer.h[3].ln_1.bias
        model.transformer.h[0].register_forward_hook(
            lambda m, a, out: out + bias if use["on"] else out)

    import dstrain
    gpt = dstrain.GPT

    def built(cfg):
        m = gpt(cfg)
        extra_use(m)
        return m
    monkeypatch.setattr(dstrain, "GPT", built)
    use["on"] = True
    ref_losses, ref_weights = dstrain.train(base_config(gradient_clipping=0.0), model_cfg, 4)[:2]
    use["on"] = False
    build = engine_mod.ProTrainEngine._protrain_build_runtime

    def build_then_use(self, *a, **k):              # profiled without the extra use
        build(self, *a, **k)
        use["on"] = True
    monkeypatch.setattr(engine_mod.ProTrainEngine, "_protrain_build_runtime", build_then_use)
    losses, weights, engine = dstrain.train(
        with_protrain(base_config(gradient_clipping=0.0), **pins), model_cfg, 4)
    assert losses == ref_losses
    assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())
    opt = engine.protrain_runtime.optimizer
    assert opt.overlap and opt._late                    # found, and its chunk deferred
    engine.destroy()


def test_a_worker_error_under_gradient_accumulation_surfaces_instead_of_hanging(monkeypatch):
    """The failed task would have given a staging buffer back; the tasks after it are skipped.
    Training must stop with the worker's error, not wait forever for a free buffer."""
    model_cfg, pins = SHAPES["all offloaded, 2 buffers"]
    calls = [0]
    accumulate = ChunkOptimizer._accumulate

    def failing(self, c, slot):
        calls[0] += 1
        if calls[0] == 1:
            raise OSError("injected: host memory error")
        accumulate(self, c, slot)
    monkeypatch.setattr(ChunkOptimizer, "_accumulate", failing)
    outcome = []

    def job():
        try:
            train(with_protrain(base_config(gradient_accumulation_steps=3), **pins), model_cfg, 2)
            outcome.append(None)
        except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
            outcome.append(e)
    with deferred_streams(monkeypatch):
        t = threading.Thread(target=job, daemon=True)
        t.start()
        t.join(timeout=120)
    assert outcome, "training hung after the worker failed"
    err = outcome[0]
    assert isinstance(err, RuntimeError) and "host-side optimizer work failed" in str(err)
    assert isinstance(err.__cause__, OSError) and "injected" in str(err.__cause__)

"""A second engine built on a model a ProTrain engine runs (the Trainer's train() called twice, a
second training stage, an evaluation engine): the first engine's last updates land in the
weights the second starts from, nothing of the first lands in the second's training, and the
first is refused by name afterwards (protrain_ds/handover.py). Against plain DeepSpeed ZeRO-0
doing the same, bit for bit."""
import time

import pytest
import torch
import deepspeed

from dstrain import TINY, base_config, with_protrain
from protrain.models import GPT, synthetic_batch
from protrain.runtime.optimizer import ChunkOptimizer

CLIPPED = base_config(gradient_clipping=1.0)
# Offloaded chunks whose CPU Adam runs on the worker thread, speculating under clipping.
OFFLOADED = dict(chunk_size="64KiB", n_persist=1, host_thread=True)


def two_stages(first: dict, second: dict, slow_last_update=None):
    """Train 3 steps with one engine, then build another on the same model and train 3 more;
    returns (losses, final weights, the first engine, whether its worker still had queued
    updates when the second was built)."""
    torch.manual_seed(0)
    model = GPT(TINY)
    losses, busy, engines = [], None, []
    for stage, cfg in enumerate((first, second)):
        if engines:
            worker = getattr(getattr(engines[0], "protrain_runtime", None), "optimizer", None)
            busy = worker is not None and worker.worker.threaded and worker.worker._q.unfinished_tasks > 0
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        engines.append(engine)
        for i in range(3):
            if stage == 0 and i == 2 and slow_last_update is not None:
                slow_last_update.setattr(ChunkOptimizer, "_update", _slowed(ChunkOptimizer._update))
            x, y = synthetic_batch(TINY, 2, seed=100 * stage + i, device=engine.device)
            loss = engine(x, y)
            engine.backward(loss * 5)          # past the clipping threshold: a speculative step
            engine.step()
            losses.append(loss.item())
        if slow_last_update is not None:
            slow_last_update.undo()
    state = model.state_dict()
    return losses, {n: state[n].detach().clone() for n, _ in model.named_parameters()}, engines[0], busy


def _slowed(update):
    def slow(self, *args, **kwargs):
        time.sleep(0.05)
        return update(self, *args, **kwargs)
    return slow


@pytest.fixture(scope="module")
def reference():
    return two_stages(CLIPPED, CLIPPED)


def _same(got, ref):
    assert got[0] == ref[0]
    for name, w in ref[1].items():
        assert torch.equal(got[1][name], w), name


def test_a_second_protrain_engine_on_the_model_trains_like_deepspeed(reference, monkeypatch):
    """The first engine's last (speculative) step is still on its worker thread when the
    second engine is built: it finishes into the weights, and the first engine's hooks and
    chunks no longer act (before: the second engine's losses parted from its second step)."""
    got = two_stages(with_protrain(CLIPPED, **OFFLOADED), with_protrain(CLIPPED, **OFFLOADED),
                     slow_last_update=monkeypatch)
    assert got[3], "the first engine's worker had finished before the second was built"
    _same(got, reference)
    first = got[2]
    x, y = synthetic_batch(TINY, 2, seed=0)
    with pytest.raises(RuntimeError, match="taken over by a newer ProTrain engine"):
        first(x, y)
    with pytest.raises(RuntimeError, match="taken over by a newer ProTrain engine"):
        first.step()


def test_a_plain_deepspeed_engine_after_a_protrain_one_trains_like_deepspeed(reference):
    got = two_stages(with_protrain(CLIPPED, **OFFLOADED), CLIPPED)
    _same(got, reference)
    with pytest.raises(RuntimeError, match="taken over by a newer DeepSpeed engine"):
        got[2].save_checkpoint("unused")


def test_an_engine_on_another_model_is_left_alone():
    torch.manual_seed(0)
    a, b = GPT(TINY), GPT(TINY)
    cfg = with_protrain(CLIPPED, **OFFLOADED)
    first, *_ = deepspeed.initialize(model=a, model_parameters=a.parameters(), config=cfg)
    x, y = synthetic_batch(TINY, 2, seed=0)
    first.backward(first(x, y))
    first.step()
    second, *_ = deepspeed.initialize(model=b, model_parameters=b.parameters(), config=cfg)
    assert first.protrain_runtime is not None and first.protrain_retired_by is None
    first.backward(first(x, y))             # both go on training their own models
    first.step()
    second.backward(second(x, y))
    second.step()

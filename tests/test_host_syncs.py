"""Where the runtime makes the host wait for the device, counted on CPU.

On a GPU a host read of device data (``.item()``, ``bool()``, ``.cpu()``) waits for every
kernel queued before it and leaves the device idle until the host queues more; a host thread
that waits on an event spins on a core unless the event is blocking. The runtime reads device
data through one seam, ``Streams.to_host``, which tests/deferred_streams.py counts per thread,
and makes every CUDA event in ``Streams._event``:

- a step reads the device once (the overflow flag and the global gradient norm together),
  however many parameters; CPU Adam's worker never does - a chunk's verdict (its gradients'
  norms and overflow flag) comes to the host on the offload queue just before its gradients,
  and is read once they are there; the norm keeps DeepSpeed's arithmetic to the bit, in fp32,
  fp16 and bf16, and its fp32 copy of a 16-bit gradient is what the memory model adds;
- every event is blocking, and no helper thread waits on a stream (which would spin).
"""
import json
import math
import threading
from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deferred_streams import deferred_streams
from dstrain import base_config, train, with_protrain
from test_ds_engine import SHAPES, deepspeed_run

from protrain.runtime.chunks import ChunkManager
from protrain.runtime.optimizer import ChunkOptimizer

MODEL, PINS = SHAPES["a mix"]          # persistent and offloaded chunks, swapped and checkpointed blocks
CLIP = '{"gradient_clipping": 1.0}'
STEPS = 4


def _deepspeed_norm(grads: list[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """deepspeed.runtime.utils.clip_grad_norm_'s arithmetic on one rank, on ``grads`` in module
    order (times the inverse loss scale under fp16, as ProTrain's step unscales)."""
    total = torch.stack([g.float().norm(2) for g in grads]).pow(2.0).sum().float()
    total = total.pow(1.0 / 2.0) * 1.0 / 1.0
    return total * inv_scale if inv_scale != 1.0 else total


class _Conversions(TorchDispatchMode):
    """The largest tensor a dtype conversion (``.float()``) allocates while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            self.largest = max(self.largest, out.numel() * out.element_size())
        return out


def _watch_step(monkeypatch):
    """Per step: the global norm the verdict read, and DeepSpeed's arithmetic on the same
    gradients; per device check, the largest fp32 copy it made."""
    seen = {"norms": [], "reference": [], "scratch": 0, "checks": 0}
    verdict, device_check = ChunkOptimizer._verdict, ChunkOptimizer._device_check

    def watched_verdict(self, inv_scale):
        grads = [g for g in (self._grad_view(p) for p in self.params_in_order) if g is not None]
        seen["reference"].append(_deepspeed_norm(grads, inv_scale))
        overflow, norm = verdict(self, inv_scale)
        seen["norms"].append(norm)
        return overflow, norm

    def watched_check(self, c, shard):
        with _Conversions() as conv:
            out = device_check(self, c, shard)
        seen["scratch"] = max(seen["scratch"], conv.largest)
        seen["checks"] += 1
        return out
    monkeypatch.setattr(ChunkOptimizer, "_verdict", watched_verdict)
    monkeypatch.setattr(ChunkOptimizer, "_device_check", watched_check)
    return seen


def test_fp32_clipping_reads_the_device_once_per_step_and_equals_deepspeed(monkeypatch):
    """Speculative updates under clipping (the worker reads every chunk's verdict) with copies
    as late as CUDA may run them: one host read per step, on the training thread; losses and
    weights equal plain DeepSpeed ZeRO-0's; the norm is DeepSpeed's to the bit."""
    ref_losses, ref_weights = deepspeed_run(MODEL, CLIP, STEPS, loss_factor=0.25)
    seen = _watch_step(monkeypatch)
    with deferred_streams(monkeypatch) as made:
        losses, weights, engine = train(with_protrain(base_config(**json.loads(CLIP)), **PINS,
                                                      speculate_chunks=99), MODEL, STEPS, loss_factor=0.25)
        stats = engine.protrain_stats()
        n_params = len(engine.protrain_runtime.optimizer.params_in_order)
        engine.destroy()
    streams = made[-1]
    assert streams.host_reads == ["MainThread"] * STEPS and n_params > 20
    assert stats["cpu_adam_overlapped_chunks"] + stats["cpu_adam_rollbacks"] > 0   # the worker read verdicts
    assert losses == ref_losses
    assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())
    assert len(seen["norms"]) == STEPS
    assert all(torch.equal(a, b.reshape(a.shape)) for a, b in zip(seen["norms"], seen["reference"]))
    assert seen["scratch"] == 0                   # fp32: float() is the gradient itself


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_clipping_reads_the_device_once_per_step_with_deepspeeds_norm(dtype, monkeypatch):
    """bf16, and fp16 with its dynamic loss scale and an overflow on step 2: one host read per
    step (flag and norm together), none on the worker; the norm equals DeepSpeed's arithmetic
    on the same 16-bit gradients, bit for bit; the largest fp32 copy the device checks make is
    the scratch the plan predicted."""
    from deepspeed.accelerator import get_accelerator
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)
    section = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}} if dtype == "fp16" \
        else {"bf16": {"enabled": True}}
    cfg = with_protrain(base_config(gradient_clipping=1.0, **section), **dict(PINS, chunk_size="55KiB"),
                        speculate_chunks=99)
    seen = _watch_step(monkeypatch)
    poison = {"on": False}
    import dstrain
    gpt = dstrain.GPT

    def built(model_cfg):
        m = gpt(model_cfg)
        m.transformer.h[0].mlp.c_fc.weight.register_hook(
            lambda g: torch.full_like(g, float("inf")) if poison["on"] else g)
        return m
    monkeypatch.setattr(dstrain, "GPT", built)
    step = ChunkOptimizer.step
    overflowed = []

    def stepping(self):
        step(self)
        overflowed.append(self.overflow)
        poison["on"] = dtype == "fp16" and len(overflowed) == 2
    monkeypatch.setattr(ChunkOptimizer, "step", stepping)
    with deferred_streams(monkeypatch) as made:
        losses, _, engine = train(cfg, MODEL, STEPS)
        predicted = engine.protrain_plan.prediction.norm_scratch_bytes
        engine.destroy()
    assert made[-1].host_reads == ["MainThread"] * STEPS
    assert overflowed == [False, False, dtype == "fp16", False]
    assert all(math.isfinite(x) for x in losses)
    finite = [(a, b) for a, b, o in zip(seen["norms"], seen["reference"], overflowed) if not o]
    assert len(finite) >= 3 and all(torch.equal(a, b.reshape(a.shape)) for a, b in finite)
    assert seen["checks"] > 0 and seen["scratch"] == predicted > 0


def test_a_verdict_read_before_its_copy_is_caught(monkeypatch):
    """The harness's side of the test above: queued after the gradients instead of before, a
    chunk's verdict is not on the host when its gradients are: the step reads the poison (NaN)."""
    offload = ChunkManager.offload_grads

    def verdict_after_gradients(self, c, target, check=None):
        late = []
        offload(self, c, target, check=None if check is None else
                lambda c, shard: late.append(check(c, shard)))
        for host, device in late:
            self.streams.copy(host, device, "offload")
    monkeypatch.setattr(ChunkManager, "offload_grads", verdict_after_gradients)
    norms = []
    step = ChunkOptimizer.step

    def stepping(self):
        step(self)
        norms.append(self.global_grad_norm)
    monkeypatch.setattr(ChunkOptimizer, "step", stepping)
    with deferred_streams(monkeypatch):
        _, _, engine = train(with_protrain(base_config(**json.loads(CLIP)), **PINS, speculate_chunks=99),
                             MODEL, 2, loss_factor=0.25)
        engine.destroy()
    assert not math.isnan(norms[0])              # the plan's first step checks on the host
    assert math.isnan(norms[1])                  # read before its copy ran: the poison


# ---- the CUDA lines of Streams, run against a recording stand-in for torch.cuda ----------------
class _FakeCuda:
    """Enough of torch.cuda for Streams: records every event made and every wait."""

    def __init__(self):
        self.events, self.waits = [], []
        fake = self

        class Event:
            def __init__(self, enable_timing=False, blocking=False, interprocess=False):
                self.blocking = blocking
                fake.events.append(self)

            def record(self, stream=None):
                pass

            def synchronize(self):
                fake.waits.append(("event", self.blocking, threading.current_thread().name))

            def query(self):
                return True

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_event(self, event):
                pass

            def synchronize(self):
                fake.waits.append(("stream", False, threading.current_thread().name))
        self.Event, self.Stream = Event, Stream
        self.compute = Stream()

    def install(self, monkeypatch):
        import torch.cuda as cuda
        for name, value in dict(Event=self.Event, Stream=self.Stream, stream=lambda s: nullcontext(),
                                current_stream=lambda device=None: self.compute,
                                set_device=lambda device: None, current_device=lambda: 0,
                                synchronize=lambda device=None: self.waits.append(
                                    ("device", False, threading.current_thread().name))).items():
            monkeypatch.setattr(cuda, name, value)
        empty = torch.empty
        monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))


def test_every_event_is_blocking_and_no_helper_thread_waits_on_a_stream(monkeypatch):
    """Streams' CUDA path against a stand-in: each event it makes is blocking (a host thread
    waiting on it sleeps), and the waits of a helper thread - CPU Adam's worker on a chunk's
    gradients, an SSD thread's copy through its bounce buffer - are event waits, never a
    stream or device synchronisation (those spin)."""
    from protrain.runtime.streams import Streams
    fake = _FakeCuda()
    fake.install(monkeypatch)
    streams = Streams(torch.device("cuda", 0))
    host, dev = torch.zeros(8), torch.ones(8)
    after = streams.compute_event()
    done = streams.copy(host, dev, "offload", after=after)
    streams.record_on("upload")
    with streams.side("offload", after=after):
        pass

    def helper():
        streams.bind_thread()
        streams.host_wait(done)                      # the CPU Adam worker
        streams.copy_in_thread(torch.zeros(8), dev)  # an SSD thread's bounce
    t = threading.Thread(target=helper, name="helper")
    t.start()
    t.join()
    assert torch.equal(streams.to_host(dev), dev)    # the step's read
    assert len(fake.events) >= 5 and all(e.blocking for e in fake.events)
    assert [w for w in fake.waits if w[2] == "helper"] == [("event", True, "helper")] * 2
    assert all(kind == "event" for kind, _, _ in fake.waits)


def test_deepspeeds_throughput_timer_does_not_synchronize_the_device(monkeypatch):
    """Issue 35, item 4: DeepSpeed's throughput timer synchronizes the device at each forward
    and step (``timers.throughput.synchronized`` defaults to true): the host would wait for the
    whole queue twice per micro-step, and nothing the plan overlaps could run ahead. Under
    ProTrain it times on the host; a JSON asking for synchronized timing is told it is
    overridden. Plain DeepSpeed synchronizes (the counter sees it)."""
    from deepspeed.accelerator import get_accelerator
    accel = get_accelerator()
    syncs = []
    real = accel.synchronize
    monkeypatch.setattr(accel, "synchronize", lambda *a, **k: (syncs.append(1), real(*a, **k))[1])
    extra = {"timers": {"throughput": {"enabled": True, "synchronized": True}}}
    _, _, engine = train(base_config(**extra), MODEL, 4)
    plain = len(syncs)
    engine.destroy()
    syncs.clear()
    _, _, engine = train(with_protrain(base_config(**extra), **PINS), MODEL, 4)
    overridden = engine.protrain_overridden
    engine.destroy()
    assert plain >= 4 and syncs == []
    assert any(o.startswith("timers.throughput.synchronized=true") for o in overridden), overridden

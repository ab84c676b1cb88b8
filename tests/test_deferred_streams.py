"""The runtime's stream ordering, checked on CPU with copies run as late as CUDA may run them.

Each test trains with DeferredStreams (tests/deferred_streams.py): side-queue copies are held
back until waited for and their destinations poisoned meanwhile, and CPU Adam runs on the
host thread overlapping backward as on a GPU. Training must still equal the synchronous run
bit for bit; the negative tests show a missing wait does not.
"""
import json
import math

import pytest
import torch

from deferred_streams import DeviceOrderError, deferred_streams
from dstrain import UNTIED, base_config, train, with_protrain
from test_ds_engine import SHAPES, deepspeed_run

from protrain.runtime.activations import HostStash
from protrain.runtime.chunks import ChunkManager, ChunkState

OFFLOADING = ["all offloaded, 1 buffer", "all offloaded, 2 buffers", "mixed chunks",
              "every block SWAP", "a mix"]


def _same(a, b):
    return all(torch.equal(a[n], b[n]) for n in b)


@pytest.mark.parametrize("shape", OFFLOADING)
def test_late_copies_and_threaded_cpu_adam_train_exactly_like_deepspeed(shape, monkeypatch):
    model_cfg, pins = SHAPES[shape]
    ref_losses, ref_weights = deepspeed_run(model_cfg, "{}")
    with deferred_streams(monkeypatch) as made:
        losses, weights, engine = train(with_protrain(base_config(), **pins), model_cfg)
        rt = engine.protrain_runtime
        assert rt.optimizer.worker.threaded          # CPU Adam on its own thread
        engine.destroy()
    streams = made[-1]
    assert streams.copies > 0 and streams.most_pending > 0   # copies really were held back
    assert losses == ref_losses
    assert _same(weights, ref_weights)


def test_late_copies_with_accumulation_clipping_and_scheduler(monkeypatch):
    extra = {"gradient_accumulation_steps": 3, "gradient_clipping": 0.05,
             "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    model_cfg, pins = SHAPES["a mix"]
    ref_losses, ref_weights = deepspeed_run(model_cfg, json.dumps(extra), 8)
    with deferred_streams(monkeypatch):
        losses, weights, engine = train(with_protrain(base_config(**extra), **pins), model_cfg, 8)
        engine.destroy()
    assert losses == ref_losses
    assert _same(weights, ref_weights)


def test_late_copies_next_to_ssd_blocks(monkeypatch, tmp_path):
    """NVMe, host swap, checkpoint and offloaded chunks in one plan, copies held back."""
    pins = dict(chunk_size="110KiB", n_persist=2, n_buffer=4, n_ssd=2, n_swap=1, n_checkpoint=1)
    ref_losses, ref_weights = deepspeed_run(UNTIED, "{}")
    with deferred_streams(monkeypatch):
        cfg = with_protrain(base_config(), ssd_path=str(tmp_path), ssd_min_bytes=0, **pins)
        losses, weights, engine = train(cfg, UNTIED)
        assert engine.protrain_runtime.activations.stats["ssd_written_bytes"] > 0
        engine.destroy()
    assert losses == ref_losses
    assert _same(weights, ref_weights)


def test_late_copies_in_bf16_equal_the_synchronous_run(monkeypatch):
    """16-bit training lands gradients over the host copy of the parameters (no fp32
    accumulator): the most delicate ordering. Compared with our own synchronous run."""
    extra = {"bf16": {"enabled": True}}
    pins = dict(chunk_size="55KiB", n_persist=2, n_buffer=4, n_swap=1, n_checkpoint=1)
    cfg = with_protrain(base_config(**extra), **pins)
    sync_losses, sync_weights, engine = train(cfg, UNTIED, 10)
    engine.destroy()
    with deferred_streams(monkeypatch):
        losses, weights, engine = train(cfg, UNTIED, 10)
        engine.destroy()
    assert losses == sync_losses
    assert _same(weights, sync_weights)


def _drop_chunk_wait(monkeypatch):
    def access(self, c):                   # ChunkManager.access without its wait
        if c.persistent:
            return
        if c.state in (ChunkState.HOST, ChunkState.CACHED):
            self.upload(c)
        if c.state == ChunkState.UPLOADING:
            c.move(ChunkState.RESIDENT)    # forgot: self.streams.wait(c.ready)
    monkeypatch.setattr(ChunkManager, "access", access)


def _drop_swap_wait(monkeypatch):
    monkeypatch.setattr(HostStash, "finish_read", lambda self, e: None)


def test_a_missing_upload_wait_reads_the_poison(monkeypatch):
    model_cfg, pins = SHAPES["all offloaded, 2 buffers"]
    ref_losses, _ = deepspeed_run(model_cfg, "{}")
    _drop_chunk_wait(monkeypatch)
    with deferred_streams(monkeypatch):
        losses, _, engine = train(with_protrain(base_config(), **pins), model_cfg, 3)
        engine.destroy()
    assert losses != ref_losses[:3]
    assert any(math.isnan(x) for x in losses)          # the poison was read


def test_a_missing_swap_prefetch_wait_is_caught(monkeypatch):
    """Never waited for, the prefetch runs late: autograd reads its poisoned destination, or
    the copy runs after autograd freed that destination, which CUDA's allocator would already
    have given to another tensor (which of the two depends on when the queue is next run)."""
    model_cfg, pins = SHAPES["every block SWAP"]
    ref_losses, _ = deepspeed_run(model_cfg, "{}")
    _drop_swap_wait(monkeypatch)
    with deferred_streams(monkeypatch):
        try:
            losses, _, engine = train(with_protrain(base_config(), **pins), model_cfg, 3)
            engine.destroy()
        except DeviceOrderError as e:
            assert "freed" in str(e)
            return
    assert any(math.isnan(x) for x in losses) and losses != ref_losses[:3]


def test_a_prefetch_never_handed_back_is_waited_for_before_its_memory_is_dropped():
    """A prefetched saved tensor that backward never asked for: on CUDA the caching allocator
    would reuse its memory while the upload still writes there, so reset waits first."""
    from torch import nn

    from deferred_streams import DeferredStreams
    from protrain.block_mode import BlockMode
    from protrain.runtime.activations import ActivationRuntime

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(2)]
    streams = DeferredStreams(torch.device("cpu"))
    acts = ActivationRuntime(blocks, [BlockMode.SWAP] * 2, streams, torch.device("cpu"),
                             [2**16] * 2, lambda t: None)
    x = torch.randn(8, 64, requires_grad=True)
    with acts.hooks():
        acts.forward_part(1)
        h = blocks[0](x)
        acts.forward_part(2)
        loss = blocks[1](h).sum()
        acts.forward_part(3)
    acts.enter_forward_block(None)
    del h
    acts.prefetch(0)
    upload = streams.queues["upload"]
    assert upload.pending() > 0                  # the prefetch is queued, not done
    acts.leave_backward_block(0)
    assert upload.pending() == 0                 # ... and done before its memory is let go
    del loss
    acts.close()


def test_a_block_saving_more_than_its_profile_grows_its_arena_once():
    """Swap arenas are sized from the profile; a block that saves more (a shape change) gets
    extra pinned memory for one iteration, then a larger arena: registrations and pinned
    bytes stop growing, and the gradients stay right."""
    from torch import nn

    from deferred_streams import DeferredStreams
    from protrain.block_mode import BlockMode
    from protrain.runtime.activations import ActivationRuntime

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(2)]
    streams = DeferredStreams(torch.device("cpu"))
    acts = ActivationRuntime(blocks, [BlockMode.SWAP] * 2, streams, torch.device("cpu"),
                             [1024, 1024], lambda t: None)     # far less than they save
    x = torch.randn(512, 64, requires_grad=True)
    ref = torch.autograd.grad(blocks[1](blocks[0](x)).sum(), x)[0]
    seen = []
    for _ in range(4):
        acts.reset()
        with acts.hooks():
            acts.forward_part(1)
            h = blocks[0](x)
            acts.forward_part(2)
            loss = blocks[1](h).sum()
            acts.forward_part(3)
        acts.enter_forward_block(None)
        del h
        acts.prefetch(1)
        g = torch.autograd.grad(loss, x)[0]
        acts.reset()
        assert torch.equal(g, ref)
        seen.append((streams.registrations, streams.pinned_bytes()))
    assert seen[1] == seen[2] == seen[3]                 # nothing more after the first iteration
    assert seen[1][1] < 2 * seen[0][1] + 2**20
    acts.close()
    assert streams.pinned_bytes() == 0


def test_pinned_memory_is_given_back_only_after_the_copies_using_it():
    from deferred_streams import DeferredStreams
    streams = DeferredStreams(torch.device("cpu"))
    host = streams.pinned(1024, torch.float32)
    host.fill_(3.0)
    dev = torch.empty(1024)
    streams.copy(dev, host, "upload")
    assert streams.pending() == 1
    streams.release_pinned()              # the upload still reads ``host``: it runs first
    assert streams.pending() == 0 and torch.equal(dev, host) and streams.pinned_bytes() == 0


def test_a_compute_wait_does_not_hold_the_host():
    """As on CUDA, ``wait`` orders the compute stream after a copy and the host goes on: a
    device-to-host copy's destination holds no value for the host until it waits (or
    something ordered after the copy runs), and its pinned memory may not be given back."""
    from deferred_streams import DeferredStreams
    streams = DeferredStreams(torch.device("cpu"))
    dev = torch.full((256,), 2.0)
    host = streams.pinned(256, torch.float32)
    done = streams.copy(host, dev, "offload", after=streams.compute_event())
    streams.wait(done)                       # compute may now overwrite ``dev``...
    dev.fill_(5.0)
    assert torch.isnan(host).all()           # ...but the host has not seen the copy land
    with pytest.raises(DeviceOrderError, match="host has not waited"):
        streams.unpin(host)
    back = torch.empty(256)
    up = streams.copy(back, host, "upload", after=done)   # a copy ordered after it sees it
    streams.wait(up)
    assert torch.equal(back, torch.full((256,), 2.0))
    streams.host_wait(done)
    assert torch.equal(host, torch.full((256,), 2.0))
    streams.host_wait(up)
    streams.unpin(host)                      # every copy using it is known done
    assert streams.pinned_bytes() == 0


def test_a_grown_swap_arena_is_given_back_after_the_host_waited_for_its_copies():
    """A block that saves more than its arena (a longer batch than profiled) swaps into extra
    pinned regions; at the end of its backward they and the arena are unregistered and
    dropped. The compute stream's waits do not hold the host, so ``HostStash.reset`` must wait
    for the swap-outs and prefetches on the host first (it did not: on CUDA a queued copy read
    or wrote pages no longer pinned)."""
    from torch import nn

    from deferred_streams import DeferredStreams
    from protrain.block_mode import BlockMode
    from protrain.runtime.activations import ActivationRuntime

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(2)]
    streams = DeferredStreams(torch.device("cpu"))
    acts = ActivationRuntime(blocks, [BlockMode.SWAP, BlockMode.NONE], streams, torch.device("cpu"),
                             [1024, 1024], lambda t: None)       # far less than block 0 saves
    x = torch.randn(256, 64, requires_grad=True)
    ref = torch.autograd.grad(blocks[1](blocks[0](x)).sum(), x)[0]
    with acts.hooks():
        acts.forward_part(1)
        h = blocks[0](x)
        acts.forward_part(2)
        loss = blocks[1](h).sum()
        acts.forward_part(3)
    acts.enter_forward_block(None)
    del h
    stash = acts.stashes[0]
    assert stash.extra                                    # the arena overflowed
    acts.prefetch(0)
    g = torch.autograd.grad(loss, x)[0]
    assert torch.equal(g, ref)
    assert any(q.acked < len(q.ops) for q in streams.queues.values())   # not known done yet
    acts.leave_backward_block(0)                          # gives the regions back
    assert not stash.extra and stash.arena.numel() >= stash.need
    acts.close()
    assert streams.pinned_bytes() == 0

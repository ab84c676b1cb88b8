"""Recompute replays Megatron's tensor-parallel RNG streams: a layer that draws dropout inside
``tracker.fork()`` gets the same mask when recomputed, and the tracker ends where a run without
recompute leaves it. The CUDA tracker needs a GPU, so a CPU tracker with the same semantics
(fork switches to a named state and stores the advanced state back) stands in."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch import nn

from protrain.block_mode import BlockMode
from protrain.runtime.activations import checkpointed_blocks
from protrain_megatron import rng


class CpuTracker:
    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.states_ = {"model-parallel-rng": g.get_state()}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = states

    @contextmanager
    def fork(self, name="model-parallel-rng"):
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


class Layer(nn.Module):
    def __init__(self, tracker):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.tracker = tracker

    def forward(self, x):
        x = torch.nn.functional.dropout(self.fc(x), 0.1)          # default generator
        with self.tracker.fork():                                  # tensor-parallel region
            x = torch.nn.functional.dropout(x, 0.5)
        return x.relu()


def _run(modes, context_fn, monkeypatch):
    tracker = CpuTracker(seed=7)
    monkeypatch.setattr(rng, "_tracker", lambda: tracker)
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer(tracker) for _ in range(3))
    x = torch.randn(8, 32, requires_grad=True)
    torch.manual_seed(1)
    with checkpointed_blocks(list(layers), modes, context_fn):
        y = x
        for layer in layers:
            y = layer(y)
        y.square().mean().backward()
    return [p.grad.clone() for p in layers.parameters()], x.grad.clone(), tracker.states_["model-parallel-rng"]


def test_recompute_replays_the_tracker_streams(monkeypatch):
    keep = _run([BlockMode.NONE] * 3, None, monkeypatch)
    ckpt = _run([BlockMode.CKPT] * 3, rng.tracker_context_fn, monkeypatch)
    for a, b in zip(keep[0], ckpt[0]):
        assert torch.equal(a, b)
    assert torch.equal(keep[1], ckpt[1])
    assert torch.equal(keep[2], ckpt[2])          # the tracker continues as without recompute


def test_without_the_tracker_context_recompute_draws_other_masks(monkeypatch):
    keep = _run([BlockMode.NONE] * 3, None, monkeypatch)
    plain = _run([BlockMode.CKPT] * 3, None, monkeypatch)
    assert not all(torch.equal(a, b) for a, b in zip(keep[0], plain[0]))


@pytest.mark.parametrize("mixed", [[BlockMode.CKPT, BlockMode.NONE, BlockMode.CKPT]])
def test_mixed_layers(monkeypatch, mixed):
    keep = _run([BlockMode.NONE] * 3, None, monkeypatch)
    got = _run(mixed, rng.tracker_context_fn, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(keep[0], got[0]))

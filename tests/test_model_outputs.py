"""Model structures that must train exactly or be refused by name (issue 32), each against plain
DeepSpeed ZeRO-0 bit for bit - the losses of every step, the final weights and every buffer -
with offloaded chunks and a checkpointed and a swapped block:

- blocks that return a dict, a Hugging Face ModelOutput, a tuple whose first element is not the
  hidden state, or a nested structure (each block's backward starts from a gradient hook on the
  hidden state, found in any structure: protrain/runtime/boundaries.py); a block that returns
  nothing its backward could start from is refused, naming it;
- BatchNorm and a module that counts its calls and keeps a moving average, in the blocks and
  around them: neither the profiled iterations nor a checkpointed block's recompute update
  them once more (protrain/runtime/buffers.py);
- an evaluation under ``torch.no_grad()`` / ``torch.inference_mode()`` in eval mode before
  training (the first forward, which profiles a training iteration all the same).

tests/output_models.py has the models. One thread: the reference runs on a shared machine."""
from __future__ import annotations

import functools

import pytest
import torch

from dstrain import base_config, with_protrain  # noqa: F401  (the one-rank environment first)
from output_models import D, KINDS, SEQ, OutputNet, batch

import deepspeed
from protrain.block_mode import BlockMode
from protrain.runtime.boundaries import OutputError, part_boundaries

# 16 KiB chunks (the largest parameter is 8 KiB): 7 chunks, 6 offloaded; block 0 swapped,
# block 1 checkpointed.
PINS = dict(chunk_size="16KiB", n_persist=1, n_checkpoint=1, n_swap=1)
STEPS = 4
EVALUATE = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@functools.lru_cache(maxsize=None)
def run(protrain: bool, kind: str = "tensor", buffers: bool = False, evaluate: str | None = None,
        compiled: bool = False):
    """Train ``STEPS`` steps of OutputNet(kind, buffers) under plain DeepSpeed or ProTrain
    (``PINS``); with ``evaluate``, first a forward in eval mode under that context; ``compiled``:
    ``engine.compile(backend="aot_eager")``. Returns the losses (the evaluation's first), the
    weights, every buffer, and for ProTrain the profile, the block modes and the number of
    offloaded chunks."""
    torch.manual_seed(0)
    model = OutputNet(kind, buffers=buffers)
    config = with_protrain(base_config(), **PINS) if protrain else base_config()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if compiled:
        torch._dynamo.reset()
        engine.compile(backend="aot_eager")
    losses = []
    if evaluate:
        model.eval()
        with EVALUATE[evaluate]():
            losses.append(engine(*batch(99)).item())
        model.train()
    for i in range(STEPS):
        loss = engine(*batch(i))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = model.state_dict()
    weights = {n: state[n].clone() for n, _ in model.named_parameters()}
    bufs = {n: b.clone() for n, b in model.named_buffers()}
    assert bufs or not buffers
    extra = None
    if protrain:
        extra = (engine.protrain_profile, engine.protrain_plan.block_modes,
                 len(engine.protrain_runtime.chunks.offloaded()))
        engine.destroy()
    return losses, weights, bufs, extra


def assert_same(got, ref) -> None:
    assert got[0] == ref[0]
    for name, w in ref[1].items():
        assert torch.equal(got[1][name], w), name
    assert got[2].keys() == ref[2].keys()
    for name, b in ref[2].items():
        assert torch.equal(got[2][name], b), name


def assert_plan_streams_and_recomputes(modes, offloaded) -> None:
    assert offloaded >= 4 and BlockMode.CKPT in modes and BlockMode.SWAP in modes, (modes, offloaded)


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_returning_any_structure_train_like_deepspeed(kind):
    """The structures change nothing in the arithmetic: one reference serves them all."""
    got = run(True, kind)
    profile, modes, offloaded = got[3]
    assert_plan_streams_and_recomputes(modes, offloaded)
    assert_same(got, run(False))
    # The profiler saw the hidden state cross every block boundary (2 x SEQ x D floats).
    assert [b.in_bytes for b in profile.blocks] == [2 * SEQ * D * 4] * len(profile.blocks)


def test_a_block_returning_no_tensor_to_start_its_backward_from_is_refused_by_name():
    torch.manual_seed(0)
    model = OutputNet("box")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=with_protrain(base_config(), **PINS))
    with pytest.raises(OutputError, match=r"block 0 \(OutBlock\) returned Box holding no "
                                          r"floating-point tensor that requires grad"):
        engine(*batch(0))


class Passing(torch.nn.Module):
    """A block returning a statistic, an auxiliary loss made after the hidden state (its
    gradient hook is the first of the block's to fire), the hidden state and its input (passed
    through)."""

    def __init__(self, skip: bool):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.skip = skip

    def forward(self, x):
        h = x if self.skip else x + self.lin(x)
        return {"stat": h.detach().sum(), "aux": self.lin(h).pow(2).mean(), "out": (h, x)}


def test_backward_boundaries_come_in_order_whatever_a_block_returns_or_passes_through():
    """Block 1 is skipped (returns its input as its hidden state): the tensor that crosses two
    boundaries reports both, the later part first, as backward crosses them."""
    blocks = [Passing(skip=i == 1) for i in range(4)]
    seen = []
    with part_boundaries(blocks, lambda phase, part, x: seen.append((phase, part))):
        x = torch.randn(2, 4, requires_grad=True) * 1
        aux = 0
        for b in blocks:
            out = b(x)
            x, aux = out["out"][0], aux + out["aux"]
        (x.sum() + aux).backward()
    assert seen == [("fwd", p) for p in range(1, 6)] + [("bwd", p) for p in range(4, -1, -1)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_buffers_end_as_plain_deepspeed_leaves_them(compiled):
    """BatchNorm statistics, num_batches_tracked, a call counter and a moving average, in the
    pre part, the post part and every block (block 1 checkpointed, its recompute in backward):
    neither profiling nor the recompute updates them once more; nor with the blocks compiled
    (aot_eager runs the operators eager mode runs, here to the same bits: the reference is
    eager DeepSpeed, a compiled one would take half a minute to compile)."""
    got = run(True, buffers=True, compiled=compiled)
    assert_plan_streams_and_recomputes(*got[3][1:])
    ref = run(False, buffers=True)
    assert ref[2]["blocks.1.norm.1.calls"] == ref[2]["pre.0.bn.num_batches_tracked"] == STEPS
    assert_same(got, ref)


@pytest.mark.parametrize("evaluate", list(EVALUATE))
def test_an_evaluation_before_training_plans_then_trains_like_deepspeed(evaluate):
    """The first forward runs in eval mode without autograd: it is profiled as a training
    iteration (in train mode, under autograd: the profile is that of a run that trains first),
    evaluates as plain DeepSpeed does, and leaves modes and buffers for the training after it."""
    got = run(True, buffers=True, evaluate=evaluate)
    assert_same(got, run(False, buffers=True, evaluate=evaluate))
    trained_first = run(True, buffers=True)[3][0]
    assert [(p.in_bytes, p.saved_bytes) for p in got[3][0].parts] == \
        [(p.in_bytes, p.saved_bytes) for p in trained_first.parts]


@pytest.mark.parametrize("evaluate", list(EVALUATE))
def test_the_profiler_measures_a_training_iteration_whatever_the_callers_mode(evaluate):
    """profile_model itself (any adapter's first forward): called in eval mode without autograd,
    it profiles what it profiles in train mode with autograd, and leaves the modes, the buffers
    and the random stream as it found them."""
    from protrain.measure.profiler import profile_model
    torch.manual_seed(0)
    model = OutputNet("dict", buffers=True)
    x, y = batch(0)
    trained = profile_model(model, lambda m: m(x, y), progress=False)
    model.eval()
    before = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.random.get_rng_state()
    with EVALUATE[evaluate]():
        got = profile_model(model, lambda m: m(x, y), progress=False)
    assert [(p.in_bytes, p.saved_bytes) for p in got.parts] == \
        [(p.in_bytes, p.saved_bytes) for p in trained.parts]
    assert not any(m.training for m in model.modules())
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.random.get_rng_state(), rng)


@pytest.mark.gpu
def test_cuda_a_model_built_on_the_host_gets_its_buffers_on_the_device_and_trains_like_deepspeed():
    """DeepSpeed moves a module built on the host to the device; ProTrain puts the parameters in
    chunks and the buffers on the device too. A checkpointed block's buffers go through host
    copies between its forward and its recompute (non-blocking, on the compute stream). GPU
    kernels are not bit-exact between two runs (atomic adds): within float32 noise."""
    results = []
    for protrain in (False, True):
        torch.manual_seed(0)
        model = OutputNet("dict", buffers=True)
        config = with_protrain(base_config(), device_memory=None, **PINS) if protrain else base_config()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        losses = []
        for i in range(STEPS):
            x, y = (t.to(engine.device) for t in batch(i))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert all(b.device.type == "cuda" for b in model.buffers())
        results.append((losses, {n: b.detach().cpu().clone() for n, b in model.named_buffers()}))
        if protrain:
            assert BlockMode.CKPT in engine.protrain_plan.block_modes
            engine.destroy()
    (ref_losses, ref_buffers), (losses, buffers) = results
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for name, b in ref_buffers.items():
        if b.is_floating_point():
            assert torch.allclose(buffers[name], b, rtol=1e-4, atol=1e-5), name
        else:
            assert torch.equal(buffers[name], b), name


@pytest.mark.parametrize("mode", [BlockMode.CKPT, BlockMode.SELECTIVE], ids=lambda m: m.letter)
def test_a_recomputed_block_leaves_the_buffers_and_gradients_of_a_plain_iteration(mode):
    """checkpointed_blocks, as the runtime and Megatron's layer hooks run CKPT and SELECTIVE
    blocks: every block recomputed in backward, two iterations, against the same model run
    plainly."""
    from protrain.runtime.activations import checkpointed_blocks
    runs = []
    for modes in ([BlockMode.NONE] * 4, [mode] * 4):
        torch.manual_seed(0)
        model = OutputNet("tensor", buffers=True)
        with checkpointed_blocks(list(model.blocks), modes):
            for i in range(2):
                model(*batch(i)).backward()
        runs.append(({n: p.grad for n, p in model.named_parameters()}, dict(model.named_buffers())))
    (grads, buffers), (ref_grads, ref_buffers) = runs[1], runs[0]
    assert all(torch.equal(g, ref_grads[n]) for n, g in grads.items())
    assert all(torch.equal(b, ref_buffers[n]) for n, b in buffers.items())

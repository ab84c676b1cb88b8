"""Long-context selective checkpointing (BlockMode.SELECTIVE): exact gradients, no attention
recompute, kept bytes as the profiler predicts them, and the search choosing it where the
cost model says it beats full checkpointing."""
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from protrain.block_mode import BlockMode
from protrain.config import KnobPins, PlannerConfig
from protrain.cost.memory import activation_walk
from protrain.models import GPT, GPTConfig, synthetic_batch
from protrain.profile.hardware import HardwareProfile
from protrain.runtime.meter import OpRecorder, StorageMeter, StorageRegistry
from protrain.measure.profiler import drop_param_grads, profile_model
from protrain.runtime.activations import checkpointed_blocks
from protrain.runtime.selective import ATTENTION_OPS
from protrain.search import InfeasibleError, search

CFG = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=256)
N, C, A = BlockMode.NONE, BlockMode.CKPT, BlockMode.SELECTIVE


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = synthetic_batch(CFG, 2, 256)
    prof = profile_model(model, lambda m: m(x, y), progress=False, micro_batch=2, seq_len=256)
    return model, x, y, prof


class _Count(TorchDispatchMode):
    """Attention kernels and matmuls run, by phase."""

    def __init__(self):
        super().__init__()
        self.phase = "fwd"
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = "attention" if func in ATTENTION_OPS else \
            "mm" if func.overloadpacket.__name__ in ("mm", "addmm") else None
        if kind:
            key = (self.phase, kind)
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


def _train_once(model, x, y, modes, grads_too=True):
    """Gradients (copied outside the metering when ``grads_too``), peak live activation bytes,
    and op counts of one iteration under ``modes``."""
    reg = StorageRegistry("cpu")
    peak = [0]
    rec = OpRecorder(reg, StorageMeter(reg), lambda n, b, pk, a: peak.__setitem__(0, max(peak[0], pk)),
                     {}, lambda i: None)
    count = _Count()
    grads = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.clone()))
             for n, p in model.named_parameters()] if grads_too else []
    torch.manual_seed(1)                       # dropout masks must be replayed by the recompute
    try:
        with checkpointed_blocks(model.transformer.h, modes), drop_param_grads(model.parameters()), \
                rec, count:
            loss = model(x, y)
            count.phase = "bwd"
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
    return grads, peak[0], count.counts


def test_selective_gradients_equal_keep_all_and_attention_is_not_recomputed(gpt):
    model, x, y, _ = gpt
    keep, _, keep_ops = _train_once(model, x, y, [N] * 4)
    sel, _, sel_ops = _train_once(model, x, y, [A] * 4)
    ckpt, _, ckpt_ops = _train_once(model, x, y, [C] * 4)
    assert keep.keys() == sel.keys() == ckpt.keys() and len(keep) == len(list(model.parameters()))
    for name, g in keep.items():
        assert torch.equal(sel[name], g), name            # bit for bit
        assert torch.equal(ckpt[name], g), name
    # Full checkpointing runs attention again in backward; the selective mode never does, but
    # it does recompute the projections and the MLP (more matmuls in backward than keep-all).
    assert keep_ops.get(("bwd", "attention"), 0) == 0 == sel_ops.get(("bwd", "attention"), 0)
    assert ckpt_ops[("bwd", "attention")] == 4 == ckpt_ops[("fwd", "attention")]
    assert sel_ops[("bwd", "mm")] > keep_ops[("bwd", "mm")]
    assert sel_ops[("bwd", "mm")] == ckpt_ops[("bwd", "mm")]


@pytest.mark.parametrize("layout", ["AAAA", "ANAN", "CCAA", "NNAA", "CACA"])
def test_selective_saved_bytes_equal_the_profilers_prediction(gpt, layout):
    model, x, y, prof = gpt
    assert prof.has_selective and all(b.in_bytes < b.sel_saved_bytes < b.saved_bytes for b in prof.blocks)
    modes = [{"N": N, "C": C, "A": A}[c] for c in layout]
    predicted, _ = activation_walk(prof, np.array([[m.code for m in modes]]))
    _, measured, _ = _train_once(model, x, y, modes, grads_too=False)
    assert predicted[0] == pytest.approx(measured, rel=1e-3)
    # and what each selective block keeps, block by block: the live bytes after forward
    sel_live = _live_after_forward(model, x, y, [A] * 4)
    ckpt_live = _live_after_forward(model, x, y, [C] * 4)
    assert sel_live - ckpt_live == sum(b.sel_saved_bytes - b.in_bytes for b in prof.blocks)


def _live_after_forward(model, x, y, modes) -> int:
    reg = StorageRegistry("cpu")
    rec = OpRecorder(reg, StorageMeter(reg), lambda *a: None, {}, lambda i: None)
    with checkpointed_blocks(model.transformer.h, modes), rec:
        loss = model(x, y)
        live = reg.live_bytes
    del loss
    return live


def _fast_machine(**over) -> HardwareProfile:
    kw = dict(name="fast", source="measured", device_type="cpu", device_memory=2**40,
              host_memory=2**40, h2d_bandwidth=1e15, d2h_bandwidth=1e15, gpu_adam_rate=1e15,
              cpu_adam_rate=1e15)
    kw.update(over)
    return HardwareProfile(**kw)


def test_search_picks_selective_over_checkpointing_where_the_model_says_it_is_faster(gpt):
    *_, prof = gpt
    walk = lambda layout: int(activation_walk(prof, np.array([[m.code for m in layout]]))[0][0])  # noqa: E731
    all_sel, all_ckpt, all_keep = walk([A] * 4), walk([C] * 4), walk([N] * 4)
    assert all_ckpt < all_sel < all_keep
    hw = _fast_machine()

    def plan(budget, **pins):
        # Activations only (model states fixed at 0, no swapping): the search picks between
        # keeping, checkpointing and the selective mode.
        cfg = PlannerConfig(device_memory=int(budget * 1.1) + 1, model_states_fixed=0,
                            pins=KnobPins(n_swap=0, **pins))
        return search(prof, hw, cfg)
    # Room for every block's attention outputs but not for keeping everything: selective wins,
    # because its recompute skips attention (the cost model's sel_recompute_time).
    p = plan(all_sel)
    assert p.knobs.n_selective == 4 and p.knobs.n_checkpoint == 0
    ckpt_only = plan(all_sel, n_selective=0)
    assert ckpt_only.knobs.n_checkpoint > 0
    assert p.prediction.step_time < ckpt_only.prediction.step_time
    saved = sum(b.fwd_time - b.sel_recompute_time for b in prof.blocks)
    assert ckpt_only.prediction.step_time - p.prediction.step_time == pytest.approx(saved, rel=1e-6)
    # Too little room for that: full checkpoints where needed, selective in what is left.
    tight = plan(all_ckpt)
    assert tight.knobs.n_checkpoint >= 1 and tight.knobs.n_checkpoint + tight.knobs.n_selective == 4
    assert tight.prediction.peak_device_bytes <= all_ckpt < p.prediction.peak_device_bytes
    assert tight.prediction.step_time <= plan(all_ckpt, n_selective=0).prediction.step_time
    with pytest.raises(InfeasibleError):
        plan(all_ckpt * 0.9)
    # With room to keep every activation, nothing is recomputed at all.
    roomy = plan(all_keep)
    assert roomy.knobs.n_selective == 0 and roomy.knobs.n_checkpoint == 0

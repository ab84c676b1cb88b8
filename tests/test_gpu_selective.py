"""Selective checkpointing on CUDA: the fused attention kernels (flash / memory-efficient /
cuDNN) are the ones the policy keeps, gradients equal keep-all (up to the attention
backward's own non-determinism), and the bytes kept are what
the profiler measured with the device allocator. Skipped without a GPU (bench/gpu_session.sh
tests runs it)."""
import numpy as np
import pytest
import torch

from protrain.block_mode import BlockMode
from protrain.cost.memory import activation_walk
from protrain.models import GPT, GPTConfig, synthetic_batch
from protrain.measure.profiler import drop_param_grads, profile_model
from protrain.runtime.activations import checkpointed_blocks
from protrain.runtime.selective import ATTENTION_OPS

pytestmark = pytest.mark.gpu

CFG = GPTConfig(n_layer=4, n_embd=512, n_head=8, vocab_size=1024, block_size=2048)


def _peak_and_grads(model, x, y, modes):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.detach().cpu()))
             for n, p in model.named_parameters()]
    with checkpointed_blocks(model.transformer.h, modes), drop_param_grads(model.parameters()):
        model(x, y).backward()
    torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    return torch.cuda.max_memory_allocated() - base, grads


def test_selective_mode_on_cuda_keeps_the_attention_kernel_outputs():
    torch.manual_seed(0)
    model = GPT(CFG).cuda().to(torch.bfloat16)
    x, y = synthetic_batch(CFG, 2, 2048, device="cuda")
    seen = set()

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in str(func):
                seen.add(func)
            return func(*args, **(kwargs or {}))
    with Spy():
        model(x, y).backward()
    assert seen & ATTENTION_OPS, f"attention ran as {seen}, none of them kept by the policy"
    prof = profile_model(model, lambda m: m(x, y), progress=False, micro_batch=2, seq_len=2048)
    assert prof.has_selective and all(b.attn_fwd_time > 0 and b.attn_bwd_time > 0 for b in prof.blocks)
    keep_peak, keep = _peak_and_grads(model, x, y, [BlockMode.NONE] * 4)
    _, again = _peak_and_grads(model, x, y, [BlockMode.NONE] * 4)
    sel_peak, sel = _peak_and_grads(model, x, y, [BlockMode.SELECTIVE] * 4)
    # The fused attention backward accumulates dQ with atomics (not bit-reproducible: the first
    # GPU run saw keep-all differ from itself), so selective must differ from keep-all no more
    # than keep-all differs from itself; where keep-all repeats exactly, exactly.
    for name, g in keep.items():
        noise = (again[name].float() - g.float()).norm().item()
        assert (sel[name].float() - g.float()).norm().item() <= 4 * noise, (name, noise)
    predicted, _ = activation_walk(prof, np.array([[BlockMode.SELECTIVE.code] * 4]))
    assert sel_peak < keep_peak
    assert predicted[0] == pytest.approx(sel_peak, rel=0.05)

"""Tiled MLP (issue 36 item 2, protrain.runtime.tiled_mlp): the runtime piece - a block's MLP
over sequence tiles, recomputed per tile in backward. Exactness against the untiled MLP
(rounding: the weight gradients are summed over tiles), one gradient per parameter per backward
(the chunk runtime's hook), composition with checkpointing, what it saves, refusals."""
import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from protrain.models import GPT, GPTConfig, synthetic_batch
from protrain.runtime.tiled_mlp import MLPTiling, TiledMLPError, tiled_mlp

CFG = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=128, block_size=40)


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _loss(model, x, y):
    return model(x, y) if isinstance(model, GPT) else model(input_ids=x, labels=y).loss


def _blocks(model):
    return list(model.transformer.h) if isinstance(model, GPT) else list(model.model.layers)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_tiled_mlps_give_the_models_loss_and_gradients_to_rounding(arch):
    """40 tokens in tiles of 16 (a short last tile): the loss and every gradient within 1e-6 of
    the untiled model's, and each parameter's gradient hook fires once per backward."""
    torch.manual_seed(0)
    a = GPT(CFG) if arch == "gpt" else _llama()
    b = copy.deepcopy(a)
    x, y = synthetic_batch(CFG, 2, seed=1)
    ref = _loss(a, x, y)
    ref.backward()
    fired = {}
    for n, p in b.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.__setitem__(n, fired.get(n, 0) + 1))
    with MLPTiling(_blocks(b), 16).active():
        got = _loss(b, x, y)
        got.backward()
    assert abs(got.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-6 * p.grad.abs().max(), n
    assert set(fired.values()) == {1} and len(fired) == len(list(b.parameters()))
    # Out of the context the MLPs are the model's own again.
    assert all("forward" not in m.__dict__ for m in MLPTiling(_blocks(b), 16).mlps)


def test_under_checkpoint_the_tiled_mlp_recomputes_to_the_same_gradients():
    torch.manual_seed(0)
    mlp = GPT(CFG).transformer.h[0].mlp
    x = torch.randn(2, 40, 64, requires_grad=True)
    g = torch.randn(2, 40, 64)
    ref = torch.autograd.grad(mlp(x), [x, *mlp.parameters()], g)
    got = torch.autograd.grad(checkpoint(lambda t: tiled_mlp(mlp, t, 16), x, use_reentrant=False),
                              [x, *mlp.parameters()], g)
    for r, t in zip(ref, got):
        assert (r - t).abs().max() <= 1e-6 * r.abs().max()


def test_only_the_mlps_input_is_saved():
    """What autograd keeps for the tiled MLP: its input, not the s x ffn intermediates."""
    torch.manual_seed(0)
    mlp = GPT(CFG).transformer.h[0].mlp
    x = torch.randn(2, 40, 64, requires_grad=True)

    def saved(fn):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            fn(x).sum()
        return sizes
    untiled = saved(mlp)
    tiled = saved(lambda t: tiled_mlp(mlp, t, 16))
    assert tiled == [x.numel()]
    assert sum(untiled) > 4 * x.numel()      # the 4x-wide intermediates


def test_without_autograd_or_with_one_tile_it_is_the_mlp_itself():
    torch.manual_seed(0)
    mlp = GPT(CFG).transformer.h[0].mlp
    x = torch.randn(2, 40, 64)
    with torch.no_grad():
        assert torch.equal(tiled_mlp(mlp, x, 16), mlp(x))
    assert torch.equal(tiled_mlp(mlp, x, 64), mlp(x))
    with pytest.raises(ValueError, match="tile=0"):
        tiled_mlp(mlp, x, 0)


def test_an_mlp_with_active_dropout_is_refused_by_name():
    torch.manual_seed(0)
    mlp = GPT(GPTConfig(n_layer=1, n_embd=64, n_head=4, vocab_size=128, block_size=40, dropout=0.1)).transformer.h[0].mlp
    x = torch.randn(2, 40, 64, requires_grad=True)
    with pytest.raises(TiledMLPError, match=r"MLP\.dropout has dropout p=0\.1"):
        tiled_mlp(mlp, x, 16)
    mlp.eval()                               # evaluation draws no masks: tiled
    assert tiled_mlp(mlp, x, 16).shape == x.shape
    with pytest.raises(TiledMLPError, match="no `mlp`"):
        MLPTiling([nn.Linear(4, 4)], 16)

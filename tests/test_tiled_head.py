"""Tiled head and loss (issue 36 item 1, protrain.runtime.tiled_head): the LM head and the
cross-entropy over tiles of head_tile tokens, chosen by the planner where the whole logits do
not fit. Exactness against the model's own head (a reordering of two sums: rounding level),
the memory model against the counted peak, pins, refusals, and what evaluation keeps."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dstrain  # noqa: F401  (the single-rank distributed environment)
from dstrain import TINY, UNTIED, base_config, train, with_protrain
from test_ds_engine import deepspeed_run

from protrain.config import ConfigError, KnobPins, PlannerConfig
from protrain.measure.profiler import profile_model
from protrain.models import GPT, GPTConfig, synthetic_batch
from protrain.profile.machines import machine
from protrain.profile.model_profile import ModelProfile
from protrain.profile.transforms import with_head_tile
from protrain.runtime.tiled_head import HeadTiling, TiledHeadError, find_head
from protrain.search import InfeasibleError, search
from protrain.units import GiB

transformers = pytest.importorskip("transformers")

WIDE = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=2000, block_size=256, tie_embeddings=False)


def _llama(vocab=300, tie=False, **extra):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                                   **extra)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _close(a: nn.Module, b: nn.Module, rel: float) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad - q.grad).abs().max() <= rel * p.grad.abs().max(), n


@pytest.mark.parametrize("tie", [False, True])
def test_a_tiled_hf_llama_gives_its_own_loss_and_gradients_to_rounding(tie):
    """Labels with -100 (HF shifts them itself), tied and untied embeddings, the Trainer's
    num_items_in_batch: the loss and every gradient within 1e-6 of the untiled head's; the
    output's logits are None in the tiled forward."""
    a = _llama(tie=tie)
    b = copy.deepcopy(a)
    x = torch.randint(0, 300, (2, 40))
    labels = x.clone()
    labels[0, :7] = -100
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(61)}):
        a.zero_grad(), b.zero_grad()
        ref = a(input_ids=x, labels=labels, **kwargs)
        ref.loss.backward()
        tiling = HeadTiling(b, 16)
        with tiling.active():
            out = b(input_ids=x, labels=labels, **kwargs)
        out.loss.backward()
        assert tiling.forwards == 1 and out.logits is None
        assert abs(out.loss.item() - ref.loss.item()) <= 1e-6 * ref.loss.item()
        _close(a, b, 1e-6)
    # Outside the context the model is its own again: logits made, same loss.
    again = b(input_ids=x, labels=labels)
    assert again.logits.shape == (2, 40, 300)
    assert torch.equal(again.loss, a(input_ids=x, labels=labels).loss)
    assert "_loss_function" not in b.__dict__ and "forward" not in b.lm_head.__dict__


def test_the_built_in_gpt_tiled_with_a_ragged_last_tile():
    torch.manual_seed(0)
    a = GPT(UNTIED)
    b = copy.deepcopy(a)
    x, y = synthetic_batch(UNTIED, 3, seed=1)        # 192 tokens: tiles of 50, the last of 42
    y[1, 3:9] = -100
    la = a(x, y)
    la.backward()
    with HeadTiling(b, 50).active():
        lb = b(x, y)
    lb.backward()
    assert abs(la.item() - lb.item()) <= 1e-6 * la.item() and la.item() != 0
    _close(a, b, 1e-6)


def test_a_model_that_transforms_its_logits_is_refused_by_name():
    """Soft-capping between the head and the loss (Gemma 2): the tiled head never makes the
    logits, so the operation on them raises naming the fix - never a loss from placeholders."""
    class Capped(GPT):
        def forward(self, idx, targets=None):
            x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
            for block in self.transformer.h:
                x = block(x)
            logits = torch.tanh(self.lm_head(self.transformer.ln_f(x)) / 30.0) * 30.0
            return self.loss_function(logits=logits, shift_labels=targets)

    torch.manual_seed(0)
    m = Capped(UNTIED)
    x, y = synthetic_batch(UNTIED, 2)
    with pytest.raises(TiledHeadError, match="head_tile"):
        with HeadTiling(m, 16).active():
            m(x, y)
    # The profiler finds it out and plans the model's own head.
    p = profile_model(m, lambda m: m(x, y), micro_batch=2, seq_len=64, progress=False, head_tiling=True)
    assert p.head is None and "to its logits" in p.head_unsupported
    assert "forward" not in m.lm_head.__dict__ and "loss_function" not in m.__dict__


def test_heads_that_cannot_be_tiled_say_why():
    class Wrapped(nn.Module):          # a head that is not a plain Linear (an adapter on it)
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Sequential(nn.Linear(4, 4))
    assert "not a plain torch.nn.Linear" in find_head(Wrapped())[1]
    assert "no lm_head" in find_head(nn.Linear(3, 3))[1]
    custom = _llama()
    custom.loss_function = lambda logits, labels, **k: F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert "not transformers' ForCausalLMLoss" in find_head(custom)[1]
    with pytest.raises(TiledHeadError, match="protrain.head_tile = 64"):
        HeadTiling(custom, 64)


def _profile(cfg=WIDE, micro_batch=2):
    torch.manual_seed(0)
    m = GPT(cfg)
    x, y = synthetic_batch(cfg, micro_batch, seed=1)
    return profile_model(m, lambda m: m(x, y), micro_batch=micro_batch, seq_len=cfg.block_size,
                         progress=False, head_tiling=True)


def test_the_profile_measures_the_tiled_head_and_round_trips(tmp_path):
    p = _profile()
    h = p.head
    # The whole logits (vocab x fp32 per token, saved by log_softmax) are gone; a tile's
    # forward and backward hold a few vocab-wide rows per token of it.
    assert h.saved_per_token <= -4 * WIDE.vocab_size
    assert h.fwd_peak_per_tile_token >= 4 * WIDE.vocab_size and h.bwd_peak_per_tile_token >= 8 * WIDE.vocab_size
    small = with_head_tile(p, 32).parts[-1]
    assert small.saved_bytes < p.parts[-1].saved_bytes and small.bwd_peak < p.parts[-1].bwd_peak
    assert small.bwd_time > p.parts[-1].bwd_time           # the recompute of each tile
    p.save(tmp_path / "p.json")
    assert ModelProfile.load(tmp_path / "p.json") == p


def test_the_planner_tiles_only_where_the_whole_logits_do_not_fit():
    p = _profile()
    hw = machine("h100-80gb").profile(host_memory=8 * GiB)
    roomy = search(p, hw, PlannerConfig())
    assert roomy.knobs.head_tile == 0 and any("chosen" in n and "whole-logits" in n for n in roomy.notes)
    # The largest budget (in 5% steps) where no plan with the whole logits fits.
    tight = search(p, hw, PlannerConfig(pins=KnobPins(head_tile=0))).prediction.peak_device_bytes
    while True:
        tight = int(tight * 0.95)
        try:
            search(p, hw, PlannerConfig(device_memory=tight, memory_margin=0.0, pins=KnobPins(head_tile=0)))
        except InfeasibleError:
            break
    plan = search(p, hw, PlannerConfig(device_memory=tight, memory_margin=0.0))
    assert plan.knobs.head_tile > 0 and plan.prediction.peak_device_bytes <= tight
    assert any("whole-logits head does not fit" in n for n in plan.notes)
    assert "head_tile" in plan.explain()
    with pytest.raises(InfeasibleError):
        search(p, hw, PlannerConfig(device_memory=tight, memory_margin=0.0, pins=KnobPins(head_tile=0)))


def test_a_pin_on_a_head_that_cannot_be_tiled_is_refused_by_name():
    p = _profile()
    from dataclasses import replace
    q = replace(p, head=None, head_unsupported="its lm_head is a LoraLinear")
    with pytest.raises(ConfigError, match=r"protrain.head_tile = 128.*LoraLinear"):
        search(q, machine("h100-80gb").profile(host_memory=8 * GiB), PlannerConfig(pins=KnobPins(head_tile=128)))


def test_the_engine_trains_tiled_like_deepspeed_and_under_the_predicted_peak():
    """A pinned tile through the DeepSpeed engine: fp32 losses within 1e-6 of plain DeepSpeed
    ZeRO-0's and weights within Adam's amplification of rounding (a few lr x 1e-3), the
    counted device peak under the prediction and within 5% of it."""
    ref_losses, ref_weights = deepspeed_run(TINY, "{}", 6)
    losses, weights, engine = train(with_protrain(base_config(), head_tile=16, accounting=True), TINY, 6)
    rt = engine.protrain_runtime
    assert engine.protrain_plan.knobs.head_tile == 16 and rt.head_tiling.forwards == 6
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-6 * abs(b)
    for n, w in ref_weights.items():
        assert torch.allclose(weights[n], w, rtol=1e-5, atol=5e-6), n
    predicted = engine.protrain_plan.prediction.peak_device_bytes
    assert 0.95 * predicted <= rt.device_peak() <= predicted
    # Evaluation is the model's own: logits, no tiled forward.
    engine.eval()
    with torch.no_grad():
        x, _ = synthetic_batch(TINY, 2)
        assert engine(x).shape == (2, TINY.block_size, TINY.vocab_size)
    assert rt.head_tiling.forwards == 6
    engine.destroy()


def test_a_config_pin_reaches_the_plan_and_zero_keeps_the_models_own_head():
    _, _, engine = train(with_protrain(base_config(), head_tile=0), TINY, 1)
    assert engine.protrain_plan.knobs.head_tile == 0 and engine.protrain_runtime.head_tiling is None
    assert "head_tile" in engine.protrain_plan.pinned
    engine.destroy()
    with pytest.raises(ConfigError, match="head_tile"):
        train(with_protrain(base_config(), head_tile=-1), TINY, 1)
    assert json.dumps(with_protrain(base_config(), head_tile=16))      # a JSON setting


@pytest.mark.parametrize("lora", [False, True])
def test_the_hf_trainer_trains_a_tiled_llama_like_plain_deepspeed(tmp_path, lora):
    """An unchanged Trainer script (tests/hfmatrix.py) with head_tile in the section: every
    training forward tiled (32 tokens in tiles of 8), losses within 1e-6 of plain DeepSpeed's,
    evaluation (the model's own head) within rounding of it; PEFT LoRA's wrapper tiles the
    base model's head."""
    import hfmatrix
    if lora:
        pytest.importorskip("peft")
    case = dict(arch="llama", eval=True, eval_steps=3, lora=lora, protrain_section={"head_tile": 8})
    pt = hfmatrix.train(dict(case, protrain=True, name="protrain"), str(tmp_path))
    ds = hfmatrix.train(dict(case, protrain=False, name="deepspeed"), str(tmp_path))
    assert pt["engine"] == "ProTrainEngine" and pt["head_tile"] == 8 and pt["tiled_forwards"] == 6
    assert len(pt["losses"]) == 6 and len(pt["eval"]) == 2
    for a, b in zip(pt["losses"] + pt["eval"], ds["losses"] + ds["eval"]):
        assert abs(a - b) <= 1e-5 * abs(b), (pt["losses"], ds["losses"], pt["eval"], ds["eval"])
    for n, w in ds["weights"].items():
        assert torch.allclose(pt["weights"][n], w, rtol=1e-4, atol=1e-5), n

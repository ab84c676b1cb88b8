"""The DeepSpeed surface beyond the Trainer's happy path (issue 33), each against plain
DeepSpeed ZeRO-0 on the same script: optimizer sections with DeepSpeed's own defaults."""
import pytest
import torch

from dstrain import TINY, base_config, train, with_protrain

OFFLOADED = dict(chunk_size="64KiB", n_persist=1)


@pytest.mark.parametrize("optimizer", [
    {"type": "AdamW", "params": {"lr": 1e-3}},
    {"type": "Adam", "params": {"lr": 1e-3}},
    {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}},
    {"type": "AdamW"},
    {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
], ids=["AdamW", "Adam", "Adam-L2", "AdamW-no-params", "AdamW-torch"])
def test_an_optimizer_section_takes_deepspeeds_defaults(optimizer):
    """Without weight_decay DeepSpeed's FusedAdam / CPU Adam decay nothing (torch's AdamW would
    decay by 0.01; it does with torch_adam, in both)."""
    cfg = base_config(gradient_clipping=1.0, optimizer=optimizer)
    ds_losses, ds_weights, _ = train(cfg, steps=4)
    pt_losses, pt_weights, engine = train(with_protrain(cfg, **OFFLOADED), steps=4)
    assert engine.protrain_runtime.chunks.offloaded()
    assert pt_losses == ds_losses
    for name, w in ds_weights.items():
        assert torch.equal(pt_weights[name], w), name

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




@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True),
], ids=["AdamW", "AdamW-fused", "Adam-foreach", "Adam-decoupled"])
def test_a_client_torch_optimizer_is_run_as_torch_runs_it(make):
    """Plain DeepSpeed steps a script's own torch Adam/AdamW itself: ProTrain runs torch's
    arithmetic with the same flags (was DeepSpeed's CPU Adam kernel: 4.8e-7 apart)."""
    cfg = base_config(gradient_clipping=1.0)
    del cfg["optimizer"]
    ds_losses, ds_weights, _ = train(cfg, steps=4, optimizer=make)
    pt_losses, pt_weights, engine = train(with_protrain(cfg, **OFFLOADED), steps=4, optimizer=make)
    assert engine.protrain_runtime.chunks.offloaded()
    assert pt_losses == ds_losses
    for name, w in ds_weights.items():
        assert torch.equal(pt_weights[name], w), name


@pytest.mark.parametrize("flag", ["amsgrad", "maximize"])
def test_a_client_optimizer_setting_the_runtime_cannot_run_is_refused_by_name(flag):
    from protrain.config import ConfigError
    cfg = base_config()
    del cfg["optimizer"]
    with pytest.raises(ConfigError, match=rf"AdamW\({flag}=True\) is not supported with protrain"):
        train(with_protrain(cfg), steps=1, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3, **{flag: True}))


def test_a_job_resumed_from_a_checkpoint_runs_its_own_pins(tmp_path):
    """load_checkpoint into a fresh engine: the job plans at its first forward with its own
    pins (not the checkpoint's plan, which was run silently before) and goes on exactly."""
    import deepspeed
    from protrain.models import GPT, synthetic_batch
    cfg = base_config(gradient_clipping=1.0)
    ds_losses, ds_weights, _ = train(cfg, steps=6)

    def run(section, steps, load=None, save=None):
        torch.manual_seed(0)
        model = GPT(TINY)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=with_protrain(cfg, **section))
        start = 0
        if load:
            engine.load_checkpoint(load)
            start = engine.global_steps
            # The weights are there before the first forward (evaluation, state_dict).
            assert torch.equal(model.state_dict()["transformer.h.0.mlp.c_fc.weight"],
                               saved_weights["transformer.h.0.mlp.c_fc.weight"])
        losses = []
        for i in range(start, start + steps):
            x, y = synthetic_batch(TINY, 2, seed=i)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if save:
            engine.save_checkpoint(save)
        state = model.state_dict()
        return losses, {n: state[n].clone() for n, _ in model.named_parameters()}, engine

    first, saved_weights, _ = run(OFFLOADED, 3, save=str(tmp_path))
    second, weights, engine = run(dict(n_persist="all", n_checkpoint=1), 3, load=str(tmp_path))
    knobs = engine.protrain_plan.knobs
    assert knobs.n_checkpoint == 1 and not engine.protrain_runtime.chunks.offloaded(), knobs
    assert first + second == ds_losses
    for name, w in ds_weights.items():
        assert torch.equal(weights[name], w), name


def test_an_engine_without_an_optimizer_runs_forward_as_deepspeed_does(capsys):
    """A reference model (TRL's DPO) or an evaluation before training: initialize without an
    optimizer. ProTrain steps aside, saying so, and plain DeepSpeed runs it; a training engine
    built on the same model afterwards is ProTrain's and trains like DeepSpeed."""
    import deepspeed
    from protrain.models import GPT, synthetic_batch
    from protrain_ds.engine import ProTrainEngine
    cfg = base_config(gradient_clipping=1.0)
    bare = {k: v for k, v in cfg.items() if k != "optimizer"}
    ds_losses, ds_weights, _ = train(cfg, steps=3)
    torch.manual_seed(0)
    model = GPT(TINY)
    x, y = synthetic_batch(TINY, 2, seed=0)
    plain, *_ = deepspeed.initialize(model=model, config=bare)
    with torch.no_grad():
        want = plain(x, y).item()
    section = dict(with_protrain(bare), protrain=dict(with_protrain(bare)["protrain"], verbosity=1))
    inference, *_ = deepspeed.initialize(model=model, config=section)
    assert not isinstance(inference, ProTrainEngine)
    assert "ProTrain steps aside" in capsys.readouterr().out
    with torch.no_grad():
        assert inference(x, y).item() == want
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=with_protrain(cfg, **OFFLOADED))
    assert isinstance(engine, ProTrainEngine)
    losses = []
    for i in range(3):
        x, y = synthetic_batch(TINY, 2, seed=i)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses == ds_losses
    state = model.state_dict()
    for name, w in ds_weights.items():
        assert torch.equal(state[name], w), name

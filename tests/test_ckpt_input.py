"""Checkpointed blocks with their inputs in host memory (issue 36 item 3, BlockMode.CKPT_HOST,
``ckpt_input: "host"``): the layout and the pin, the memory and time models against
hand-computed cases, the search against brute force, the planner's choice, and training
through the DeepSpeed engine - exact against plain DeepSpeed with the copies run as late as
CUDA may run them, and under the predicted peak."""
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import dstrain  # noqa: F401  (the single-rank distributed environment)
from deferred_streams import deferred_streams
from dstrain import TINY, UNTIED, base_config, train, with_protrain
from test_ds_engine import deepspeed_run
from test_memory_model import walk, walk_profile

from protrain.block_mode import (CKPT, CKPT_HOST, CKPT_SSD, NONE, SWAP, BlockMode, layout_block_modes,
                                 modes_string)
from protrain.config import ConfigError, KnobPins, PlannerConfig
from protrain.cost.memory import ssd_bytes, swap_host_bytes
from protrain.profile.analytic import PRESETS, analytic_profile
from protrain.profile.machines import machine
from protrain.runtime.activations import HostStash
from protrain.search import InfeasibleError, evaluate, search
from protrain.units import GiB

PINS = dict(chunk_size="230KiB", n_persist=2, n_buffer=2, n_swap=0, n_checkpoint=3, n_selective=0)


def test_the_layout_and_the_pin():
    assert modes_string(layout_block_modes(8, 2, 3, 0, 1, "host")) == "SSHHNHAN"
    assert modes_string(layout_block_modes(8, 2, 3, 0, 1)) == "SSCCNCAN"
    assert modes_string(layout_block_modes(8, 2, 3, 0, 1, "drive")) == "SSFFNFAN"
    for v in ("device", "host", "drive"):
        assert PlannerConfig.from_dict({"ckpt_input": v}).pins.ckpt_input == v
    assert PlannerConfig.from_dict({"ckpt_input": "auto"}).pins.ckpt_input is None
    with pytest.raises(ConfigError, match=r"protrain\.ckpt_input = 'cpu'.*\"host\""):
        PlannerConfig.from_dict({"ckpt_input": "cpu"})


def test_the_memory_walk_frees_the_input_and_carries_its_copy():
    # walk_profile: blocks of in 5, saved 20. b0 with its input on the host frees all 20
    # (CKPT frees 15): the peak, post's backward, is 70 - 20 = 50 (55 with CKPT). Its input's
    # copy is in flight during b1's forward (60 - 20 + 5) and its prefetch during b1's
    # backward (60 - 20 + 5), both 45.
    assert walk([CKPT, NONE]) == (55, 7)
    assert walk([CKPT_HOST, NONE]) == (50, 7)
    # Both on the host: b1's recompute bump (50 - 20 - 15 + 35 = 50) plus b0's input coming
    # back during it: 55, as with both inputs kept on the device.
    assert walk([CKPT_HOST, CKPT_HOST]) == (55, 5)
    prof = walk_profile()
    assert int(swap_host_bytes(prof, np.array([[CKPT_HOST, CKPT_HOST]]))[0]) == 10
    assert int(swap_host_bytes(prof, np.array([[SWAP, CKPT_HOST]]))[0]) == 25
    # On the drive: the same device walk; the inputs are the drive's bytes, not the host's.
    assert walk([CKPT_SSD, NONE]) == (50, 7) and walk([CKPT_SSD, CKPT_SSD]) == (55, 5)
    assert int(swap_host_bytes(prof, np.array([[CKPT_SSD, CKPT_SSD]]))[0]) == 0
    assert int(ssd_bytes(prof, np.array([[CKPT_SSD, CKPT_HOST]]))[0]) == 5


def _llama_plan(seq, **pins):
    hw = machine("h100-80gb").profile().with_limits(host_memory=1024 * GiB)
    prof = analytic_profile(replace(PRESETS["llama3-8b"], micro_batch=1, seq_len=seq), hw)
    return prof, hw, search(prof, hw, PlannerConfig(pins=KnobPins(**pins)))


def test_the_planner_moves_the_inputs_where_that_lets_a_longer_sequence_fit():
    """Llama-3 8B at 196608 tokens on an H100: no plan fits with the checkpointed inputs on
    the device; with them on the host one does, and the plan says both. Pinned to the
    device, the same length is refused with what it needs."""
    prof, hw, plan = _llama_plan(196608, mlp_tile=0)      # (tiled MLPs fit it on the device)
    k = plan.knobs
    assert k.ckpt_input == "host" and k.n_checkpoint > 0 and "ckpt_input" not in plan.pinned
    assert sum(m == BlockMode.CKPT_HOST for m in plan.block_modes) == k.n_checkpoint
    assert any("inputs on the device does not fit" in n for n in plan.notes)
    assert any("inputs in host memory" in n and "chosen" in n for n in plan.notes)
    assert "H / F checkpoint from host / drive" in plan.explain() and "ckpt_input" in plan.explain()
    with pytest.raises(InfeasibleError):
        _llama_plan(196608, ckpt_input="device", mlp_tile=0)
    # The copies are the inputs: the same knobs with the inputs on the device move exactly
    # the checkpointed blocks' input bytes fewer each way (and need more device memory).
    dev = evaluate(prof, hw, replace(k, ckpt_input="device"))
    inputs = sum(b.in_bytes for b, m in zip(prof.blocks, plan.block_modes) if m == BlockMode.CKPT_HOST)
    assert plan.prediction.d2h_bytes - dev.prediction.d2h_bytes == inputs
    assert plan.prediction.h2d_bytes - dev.prediction.h2d_bytes == inputs
    assert plan.prediction.swap_host_bytes - dev.prediction.swap_host_bytes == inputs
    assert dev.prediction.peak_device_bytes > plan.prediction.peak_device_bytes


def test_a_plan_that_fits_either_way_keeps_the_inputs_on_the_device():
    """Where both fit within the cost model's error band, the inputs stay (no copies)."""
    _, _, plan = _llama_plan(8192)
    assert plan.knobs.ckpt_input == "device"
    assert all(m != BlockMode.CKPT_HOST for m in plan.block_modes)


def test_training_equals_deepspeed_with_late_copies_and_moves_the_inputs(monkeypatch):
    """Three checkpointed blocks of four with their inputs on the host, offloaded chunks, every
    side-queue copy held back until waited for (tests/deferred_streams.py): losses and weights
    equal plain DeepSpeed ZeRO-0's bit for bit; each step copies the three inputs out and back."""
    ref_losses, ref_weights = deepspeed_run(UNTIED, "{}", 6)
    with deferred_streams(monkeypatch) as made:
        losses, weights, engine = train(with_protrain(base_config(), ckpt_input="host", **PINS), UNTIED, 6)
        plan, acts = engine.protrain_plan, engine.protrain_runtime.activations
        assert modes_string(plan.block_modes).count("H") == 3 and plan.knobs.ckpt_input == "host"
        per_step = 3 * 2 * UNTIED.block_size * UNTIED.n_embd * 4      # micro-batch 2, fp32 inputs
        assert acts.stats["swapped_bytes"] == 6 * per_step
        assert acts.stats["prefetched_bytes"] == 6 * per_step and acts.stats["forwarded"] == 0
        engine.destroy()
    assert made[-1].copies > 0
    assert losses == ref_losses
    assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())


def test_inputs_on_the_drive_train_like_deepspeed_with_late_copies(monkeypatch, tmp_path):
    """ckpt_input "drive": the three inputs written to the block files under ssd_path and read
    back one block ahead, every side-queue copy held back: bit for bit with plain DeepSpeed."""
    ref_losses, ref_weights = deepspeed_run(UNTIED, "{}", 4)
    with deferred_streams(monkeypatch):
        cfg = with_protrain(base_config(), ckpt_input="drive", ssd_path=str(tmp_path), ssd_min_bytes=0,
                            n_ssd=0, **PINS)      # (SSD blocks are the planner's call on the drive's speed)
        losses, weights, engine = train(cfg, UNTIED, 4)
        plan, acts = engine.protrain_plan, engine.protrain_runtime.activations
        assert modes_string(plan.block_modes).count("F") == 3 and plan.prediction.ssd_bytes > 0
        per_step = 3 * 2 * UNTIED.block_size * UNTIED.n_embd * 4
        assert acts.stats["ssd_written_bytes"] == acts.stats["ssd_read_bytes"] == 4 * per_step
        assert acts.stats["swapped_bytes"] == 0
        engine.destroy()
    assert losses == ref_losses
    assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())


def test_inputs_on_the_drive_without_one_are_refused_by_name():
    hw = machine("h100-80gb").profile()
    prof = analytic_profile(replace(PRESETS["llama3-8b"], micro_batch=1, seq_len=8192), hw)
    with pytest.raises(InfeasibleError, match=r"ckpt_input = \"drive\".*ssd_path"):
        search(prof, hw, PlannerConfig(pins=KnobPins(ckpt_input="drive")))


def test_a_missing_wait_for_an_input_coming_back_is_caught(monkeypatch):
    """The negative of the test above: without the wait for the prefetched input, the recompute
    reads the poisoned destination (or the copy lands on freed memory)."""
    from deferred_streams import DeviceOrderError
    ref_losses, _ = deepspeed_run(UNTIED, "{}", 3)
    monkeypatch.setattr(HostStash, "finish_read", lambda self, e: None)
    with deferred_streams(monkeypatch):
        try:
            losses, _, engine = train(with_protrain(base_config(), ckpt_input="host", **PINS), UNTIED, 3)
            engine.destroy()
        except DeviceOrderError as e:
            assert "freed" in str(e)
            return
    assert any(math.isnan(x) for x in losses) and losses != ref_losses[:3]


def test_the_counted_device_peak_drops_by_the_inputs_and_stays_under_the_prediction():
    peaks = {}
    for where in ("device", "host"):
        _, _, engine = train(with_protrain(base_config(), accounting=True, ckpt_input=where,
                                           **dict(PINS, n_checkpoint=4, n_persist=5, n_buffer=0)), TINY, 3)
        rt, plan = engine.protrain_runtime, engine.protrain_plan
        predicted = plan.prediction.peak_device_bytes
        assert 0.95 * predicted <= rt.device_peak() <= predicted, where
        peaks[where] = rt.device_peak()
        engine.destroy()
    assert peaks["host"] < peaks["device"]


def test_megatron_keeps_the_inputs_on_the_device_and_refuses_the_pin():
    from protrain_megatron.apply import _pins
    with pytest.raises(ValueError, match="ckpt_input"):
        _pins({"ckpt_input": "host"})


def test_an_input_given_as_a_keyword_is_said_once(caplog):
    """torch's checkpoint keeps keyword arguments itself: a block called as block(x=...) keeps
    its input on the device, which the runtime says (the training is unchanged)."""
    from protrain.runtime.activations import ActivationRuntime
    from protrain.runtime.streams import Streams
    blocks = [torch.nn.Linear(4, 4) for _ in range(2)]
    rt = ActivationRuntime(blocks, [BlockMode.CKPT_HOST, BlockMode.NONE], Streams(torch.device("cpu")),
                           torch.device("cpu"), [64, 64], lambda t: None, input_bytes=[64, 64])
    x = torch.randn(2, 4, requires_grad=True)
    with rt.hooks(), caplog.at_level("WARNING", logger="protrain"):
        for _ in range(2):
            rt.enter_forward_block(0)
            y = blocks[0](input=x)
            rt.enter_forward_block(1)
            y = blocks[1](y)
            rt.enter_forward_block(None)
            y.sum().backward()
            rt.reset()
    assert sum("positional" in r.message for r in caplog.records) == 1
    rt.close()


def test_an_incumbent_prunes_the_inner_search_without_changing_its_answer():
    """``loop.search(beat=...)``, how the outer loop looks for a plan with the inputs on the
    host only below the device plan's step: None when nothing beats it (with fewer
    simulations), the same plan as without it otherwise."""
    from test_search import CASES, small_hw
    from protrain.profile.analytic import analytic_profile as shape_profile
    from protrain.search.loop import search as inner
    shape, dev, host, sizes = CASES[0]
    hw = small_hw(device_memory=dev, host_memory=host)
    prof = shape_profile(shape, hw)
    config = PlannerConfig(chunk_sizes=sizes)
    free = inner(prof, hw, config)
    t = free.prediction.step_time
    same = inner(prof, hw, config, beat=t * 1.5)
    assert same.knobs == free.knobs and same.prediction.step_time == t
    # The hedge may take a plan up to the error band slower than the fastest: below that band
    # nothing is left.
    assert inner(prof, hw, config, beat=t / (1 + config.time_tolerance) * 0.999) is None


@pytest.mark.parametrize("lora", [False, True])
def test_the_hf_trainer_trains_a_llama_with_its_checkpointed_inputs_on_the_host_like_deepspeed(tmp_path, lora):
    """An unchanged Trainer script (tests/hfmatrix.py) with "ckpt_input": "host" and both
    decoder layers checkpointed: the layers' inputs go to host memory every step (positional,
    as transformers passes them) and the fp32 losses, evaluation and weights equal plain
    DeepSpeed's exactly (the recompute runs the same operators); PEFT LoRA's frozen embedding
    (an input that needs no gradient) too."""
    import hfmatrix
    if lora:
        pytest.importorskip("peft")
    case = dict(arch="llama", eval=True, eval_steps=3, lora=lora,
                protrain_section={"ckpt_input": "host", "n_checkpoint": 2})
    pt = hfmatrix.train(dict(case, protrain=True, name="protrain"), str(tmp_path))
    ds = hfmatrix.train(dict(case, protrain=False, name="deepspeed"), str(tmp_path))
    assert pt["engine"] == "ProTrainEngine" and pt["modes"] == "HH" and pt["moved_to_host"] > 0
    assert len(pt["losses"]) == 6 and pt["losses"] == ds["losses"] and pt["eval"] == ds["eval"]
    for n, w in ds["weights"].items():
        assert torch.equal(pt["weights"][n], w), n


def _engine(ds_config, model_cfg):
    import deepspeed
    from protrain.models import GPT
    torch.manual_seed(0)
    model = GPT(model_cfg)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)[0]


def _steps(engine, model_cfg, steps) -> list[float]:
    from protrain.models import synthetic_batch
    losses = []
    for i in steps:
        x, y = synthetic_batch(model_cfg, 2, seed=i, device=engine.device)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_a_checkpoint_moves_between_plans_with_the_inputs_on_the_host_and_on_the_device(tmp_path):
    """Saved under a plan with the inputs in host memory, loaded into one that keeps them on the
    device: the run continues as one that never stopped, bit for bit with plain DeepSpeed."""
    ref_losses, ref_weights = deepspeed_run(UNTIED, "{}", 6)
    cfg = lambda where: with_protrain(base_config(), ckpt_input=where, **PINS)  # noqa: E731
    engine = _engine(cfg("host"), UNTIED)
    first = _steps(engine, UNTIED, range(3))
    assert engine.protrain_plan.knobs.ckpt_input == "host"      # (planned at the first forward)
    engine.save_checkpoint(str(tmp_path), tag="a")
    engine.destroy()
    engine = _engine(cfg("device"), UNTIED)
    engine.load_checkpoint(str(tmp_path), tag="a")
    second = _steps(engine, UNTIED, range(3, 6))
    assert engine.protrain_plan.knobs.ckpt_input == "device"
    state = engine.module.state_dict()
    engine.destroy()
    assert first + second == ref_losses
    assert all(torch.equal(state[n].float(), w) for n, w in ref_weights.items())


def test_under_a_budget_only_the_moved_inputs_fit_the_planner_moves_them_and_trains():
    """The issue's must-show on CPU: a device budget between the two plans' needs (every other
    knob pinned), "ckpt_input" on auto: the inputs on the device do not fit, the planner puts
    them in host memory, the run trains as plain DeepSpeed does, and its counted device peak is
    within 5% under the prediction."""
    from protrain.models import GPTConfig
    long = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=256, tie_embeddings=False)
    pins = dict(PINS, n_checkpoint=4)
    need = {}
    for where in ("device", "host"):
        _, _, engine = train(with_protrain(base_config(), ckpt_input=where, **pins), long, 1)
        need[where] = engine.protrain_plan.prediction.peak_device_bytes * (1 + engine.protrain_plan.memory_margin)
        engine.destroy()
    assert need["host"] < need["device"]
    budget = int((need["host"] + need["device"]) / 2)
    ref_losses, ref_weights = deepspeed_run(long, "{}", 4)
    losses, weights, engine = train(with_protrain(base_config(), device_memory=budget, accounting=True, **pins),
                                    long, 4)
    plan, rt = engine.protrain_plan, engine.protrain_runtime
    assert plan.knobs.ckpt_input == "host" and "ckpt_input" not in plan.pinned
    assert any("inputs on the device does not fit" in n for n in plan.notes)
    predicted = plan.prediction.peak_device_bytes
    assert 0.95 * predicted <= rt.device_peak() <= predicted
    engine.destroy()
    assert losses == ref_losses
    assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())

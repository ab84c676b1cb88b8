"""protrain_megatron on a megatron-core GPTModel on CPU: every block mode and a mixed plan give
the gradients of the run without a policy (dropout on, so recompute must replay the RNG), the
recompute FLOPs are exactly the plan's, SWAP / SSD move saved tensors off the device, and the
planner's predicted activation peak is what the runtime counts."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

pytest.importorskip("megatron.core")

from dpworker import free_port  # noqa: E402
from megatron_cpu import batch, cpu_rng_states, gpt, loss_and_grads, two_ranks  # noqa: E402

from protrain.block_mode import BlockMode  # noqa: E402
from protrain.profile.hardware import HardwareProfile  # noqa: E402
from protrain.search import InfeasibleError  # noqa: E402
from protrain_megatron import ActivationPolicy, MegatronStates, plan_activations  # noqa: E402

GiB = 2**30
HW = HardwareProfile(name="cpu-test", source="measured", device_type="cpu", device_memory=GiB,
                     host_memory=GiB, h2d_bandwidth=1e9, d2h_bandwidth=1e9, gpu_adam_rate=1e9,
                     cpu_adam_rate=1e8, nvme_write_bandwidth=1e9, nvme_read_bandwidth=1e9,
                     nvme_free_bytes=GiB)
SEQ = 64


@pytest.fixture(autouse=True)
def _cpu_rng(monkeypatch):
    cpu_rng_states(monkeypatch)


@pytest.fixture(scope="module")
def model():
    # Hidden dropout on (recompute must replay the RNG); attention dropout off, so CPU's fused
    # attention kernel runs and the selective mode can keep its output.
    return gpt(num_layers=4, hidden=128, seq=SEQ, attention_dropout=0.0)


@pytest.fixture(scope="module")
def sample():
    return batch(seq=SEQ)


@pytest.fixture(scope="module")
def reference(model, sample):
    return loss_and_grads(model, sample)


def _plan(model, sample, **kw):
    kw.setdefault("hardware", HW)
    kw.setdefault("ssd_min_bytes", 0)        # this model's tensors are all small
    return plan_activations(model, sample, progress=False, verbose=False, **kw)


CASES = {
    "keep": ({"n_checkpoint": 0, "n_swap": 0}, True, "NNNN"),
    "ckpt-native": ({"n_checkpoint": 4, "n_swap": 0}, True, "CCCC"),
    "ckpt-hooks": ({"n_checkpoint": 4, "n_swap": 0}, False, "CCCC"),
    # Two checkpointed blocks among four, selective recompute pinned off: with it free, a
    # measured profile whose third block's forward came out slow by noise made "CCAN" (blocks
    # 0, 1 recomputed whole and 2 selectively) faster than "CNCN" (the compat floors job).
    "ckpt-2-native": ({"n_checkpoint": 2, "n_swap": 0, "n_selective": 0}, True, "CCNN"),
    "ckpt-2-hooks": ({"n_checkpoint": 2, "n_swap": 0, "n_selective": 0}, False, "CNCN"),
    "swap": ({"n_checkpoint": 0, "n_swap": 4}, True, "SSSS"),
    "ssd": ({"n_checkpoint": 0, "n_swap": 0, "n_ssd": 4}, True, "DDDD"),
    "mixed": ({"n_checkpoint": 1, "n_swap": 1, "n_ssd": 1}, True, "DSCN"),
    "selective": ({"n_checkpoint": 0, "n_swap": 0, "n_selective": 4}, True, "AAAA"),
    "selective-mixed": ({"n_checkpoint": 1, "n_swap": 1, "n_selective": 1}, True, "SCAN"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_equal_the_run_without_a_policy(case, model, sample, reference, tmp_path):
    pins, native, layout = CASES[case]
    ssd = str(tmp_path) if pins.get("n_ssd") else None
    applied = _plan(model, sample, pins=pins, prefer_native=native, ssd_path=ssd)
    try:
        assert "".join(m.letter for m in applied.plan.block_modes) == layout
        assert applied.policy.native == (native and set(layout) <= {"C", "N"})
        for _ in range(2):      # twice: the stashes are reused across iterations
            loss, grads = loss_and_grads(model, sample)
            assert torch.equal(loss, reference[0])
            assert grads.keys() == reference[1].keys()
            for name, g in grads.items():
                assert torch.equal(g, reference[1][name]), name
        stats = applied.policy.activations.stats if applied.policy.activations else {}
        if "S" in layout:
            assert stats["swapped_bytes"] > 0 and stats["prefetched_bytes"] == stats["swapped_bytes"]
        if "D" in layout:
            assert stats["ssd_written_bytes"] > 0
            assert stats["ssd_read_bytes"] + stats["writes_skipped"] > 0
    finally:
        applied.close()
    # close() restores the model exactly: Megatron's config and the layers' forwards.
    assert model.config.recompute_granularity is None and model.config.recompute_num_layers is None
    assert all("forward" not in layer.__dict__ for layer in model.decoder.layers)
    assert "forward" not in model.__dict__
    assert not list(tmp_path.iterdir())          # the per-run NVMe directory is gone


@pytest.mark.parametrize("case", ["swap", "mixed"])
def test_gradients_equal_with_copies_run_as_late_as_cuda_may(case, model, sample, reference,
                                                              tmp_path, monkeypatch):
    """SWAP copies held back until waited for, their destinations poisoned meanwhile
    (tests/deferred_streams.py): the hooks wait where they must."""
    from deferred_streams import deferred_streams
    pins, _, _ = CASES[case]
    with deferred_streams(monkeypatch) as made:
        applied = _plan(model, sample, pins=pins, ssd_path=str(tmp_path))
        try:
            for _ in range(2):
                loss, grads = loss_and_grads(model, sample)
                assert torch.equal(loss, reference[0])
                for name, g in grads.items():
                    assert torch.equal(g, reference[1][name]), name
        finally:
            applied.close()
    assert made and made[-1].most_pending > 0


def test_native_plan_sets_megatrons_recompute_config(model, sample):
    applied = _plan(model, sample, pins={"n_checkpoint": 3, "n_swap": 0})
    try:
        c = model.config
        assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "block", 3)
        assert "recompute_num_layers=3" in applied.explain()
        assert "1-3 recompute, 4 keep" in applied.explain()
    finally:
        applied.close()
    assert model.config.recompute_granularity is None


def test_the_search_chooses_the_selective_mode_where_it_is_faster(model, sample, reference):
    """Unpinned, at a budget that holds every layer's attention output but not every
    activation: the search puts layers in the selective mode, faster than the best plan
    without it, and the plan trains exactly."""
    pinned = _plan(model, sample, pins={"n_checkpoint": 0, "n_swap": 0, "n_selective": 4})
    profile = pinned.profile
    pinned.close()
    budget = int(pinned.plan.prediction.peak_device_bytes * 1.1) + 1
    keep = _plan(model, sample, profile=profile, pins={"n_checkpoint": 0, "n_swap": 0, "n_selective": 0},
                 device_memory=2**40)
    keep.close()
    assert keep.plan.prediction.peak_device_bytes * 1.1 > budget        # keeping all does not fit
    without = _plan(model, sample, profile=profile, pins={"n_swap": 0, "n_selective": 0},
                    device_memory=budget, prefer_native=False)
    without.close()
    applied = _plan(model, sample, profile=profile, pins={"n_swap": 0}, device_memory=budget)
    try:
        assert applied.plan.knobs.n_selective >= 1, applied.plan.block_modes
        assert applied.plan.prediction.step_time < without.plan.prediction.step_time
        assert not applied.policy.native                  # Megatron's own recompute has no such mode
        loss, grads = loss_and_grads(model, sample)
        assert torch.equal(loss, reference[0])
        assert all(torch.equal(grads[n], reference[1][n]) for n in reference[1])
    finally:
        applied.close()


def _sdpa_flops(q, k, v, *args, out_shape=None, **kwargs):
    """Forward FLOPs of CPU fused attention (torch's counter has no formula for the CPU
    kernel): two [s, s] matmuls per head."""
    b, h, s, d = q
    return 4 * b * h * s * k[2] * d


def _sdpa_backward_flops(grad_out, q, k, v, *args, out_shape=None, **kwargs):
    return 2 * _sdpa_flops(q, k, v)


ATTENTION_FLOPS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops,
                   torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
                   _sdpa_backward_flops}
"""By operator packet, as the counter looks formulas up and reports counts."""


def _counter():
    return FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS)


def _backward_flops(model, sample):
    torch.manual_seed(5)
    model.zero_grad(set_to_none=True)
    loss = model(**sample).float().mean()
    with _counter() as fc:
        loss.backward()
    return fc.get_total_flops()


def _layer_forward_flops(model, sample, attention_only=False):
    """One decoder layer's forward FLOPs (every layer has the same), or its attention
    kernel's alone."""
    with _counter() as fc:
        with torch.no_grad():
            model(**sample)
    counts = fc.get_flop_counts()
    attention = set(ATTENTION_FLOPS)
    per_layer = [sum(n for op, n in v.items() if op in attention or not attention_only)
                 for k, v in counts.items()
                 if k.rsplit(".", 1)[0].endswith("decoder.layers") and k.rsplit(".", 1)[1].isdigit()]
    assert len(per_layer) == 4 and len(set(per_layer)) == 1, per_layer
    return per_layer[0]


@pytest.mark.parametrize("pins,native", [({"n_checkpoint": 0, "n_swap": 4}, True),
                                         ({"n_checkpoint": 1, "n_swap": 0}, False),
                                         ({"n_checkpoint": 2, "n_swap": 0}, True),
                                         ({"n_checkpoint": 4, "n_swap": 0}, False),
                                         ({"n_checkpoint": 1, "n_swap": 2}, True),
                                         ({"n_checkpoint": 0, "n_swap": 0, "n_selective": 4}, True),
                                         ({"n_checkpoint": 1, "n_swap": 1, "n_selective": 2}, True)])
def test_flop_counter_shows_exactly_the_planned_recompute(pins, native, model, sample):
    base = _backward_flops(model, sample)
    layer = _layer_forward_flops(model, sample)
    attention = _layer_forward_flops(model, sample, attention_only=True)
    assert layer > attention > 0
    applied = _plan(model, sample, pins=pins, prefer_native=native)
    try:
        got = _backward_flops(model, sample)
    finally:
        applied.close()
    # Recompute replays each checkpointed layer's forward once in backward, and each
    # selective layer's forward but its attention (whose output was kept); nothing else.
    assert got - base == pins["n_checkpoint"] * layer + pins.get("n_selective", 0) * (layer - attention)


@pytest.mark.parametrize("pins", [{"n_checkpoint": 0, "n_swap": 0}, {"n_checkpoint": 0, "n_swap": 4},
                                  {"n_checkpoint": 4, "n_swap": 0}, {"n_checkpoint": 1, "n_swap": 2},
                                  {"n_checkpoint": 0, "n_swap": 0, "n_ssd": 2},
                                  {"n_checkpoint": 0, "n_swap": 0, "n_selective": 4},
                                  {"n_checkpoint": 1, "n_swap": 1, "n_selective": 2}])
def test_runtime_accounting_matches_the_predicted_activation_peak(pins, model, sample, tmp_path):
    applied = _plan(model, sample, pins=pins, prefer_native=False, accounting=True,
                    ssd_path=str(tmp_path) if pins.get("n_ssd") else None)
    try:
        loss_and_grads(model, sample)
        model.zero_grad(set_to_none=False)   # gradients preallocated (Megatron's grad buffer)
        applied.policy.reset_peak()
        torch.manual_seed(5)
        model(**sample).float().mean().backward()
        measured = applied.policy.activation_peak()
    finally:
        applied.close()
    predicted = applied.plan.prediction.activation_peak_bytes
    assert abs(measured - predicted) <= 0.02 * predicted, (measured, predicted)


def test_swap_moves_saved_tensors_off_the_device(model, sample):
    peaks = {}
    for name, pins in (("keep", {"n_checkpoint": 0, "n_swap": 0}), ("swap", {"n_checkpoint": 0, "n_swap": 4})):
        applied = _plan(model, sample, pins=pins, prefer_native=False, accounting=True)
        try:
            loss_and_grads(model, sample)
            model.zero_grad(set_to_none=False)
            applied.policy.reset_peak()
            before = applied.policy.activations.stats["swapped_bytes"]
            torch.manual_seed(5)
            model(**sample).float().mean().backward()
            peaks[name] = applied.policy.activation_peak()
            swapped = applied.policy.activations.stats["swapped_bytes"] - before
            saved = sum(b.saved_bytes for b in applied.profile.blocks)
        finally:
            applied.close()
    # Every distinct storage the layers saved went to host memory, and the device peak fell by
    # two layers' worth: with one layer prefetched ahead, two are back on the device at a time.
    assert swapped == saved
    assert peaks["swap"] <= peaks["keep"] - 1.95 * saved / 4


def test_search_picks_modes_that_fit_the_budget(model, sample):
    keep = _plan(model, sample, pins={"n_checkpoint": 0, "n_swap": 0})
    p0 = keep.plan.prediction
    keep.close()
    states = MegatronStates(params=10**6, param_bytes=4, optimizer_bytes=8)   # 16 MB
    budget = int((states.total_bytes + 0.6 * p0.activation_peak_bytes) * 1.1)
    applied = _plan(model, sample, states=states, device_memory=budget)
    try:
        p = applied.plan.prediction
        assert p.model_state_bytes == states.total_bytes
        assert p.peak_device_bytes * 1.1 <= budget
        assert applied.plan.knobs.n_checkpoint + applied.plan.knobs.n_swap > 0
    finally:
        applied.close()
    with pytest.raises(InfeasibleError):
        _plan(model, sample, states=states, device_memory=states.total_bytes)


def test_plan_file_round_trip(model, sample, tmp_path):
    path = tmp_path / "plan.json"
    first = _plan(model, sample, pins={"n_checkpoint": 1, "n_swap": 1}, plan_file=str(path))
    first.close()
    assert path.exists()
    again = plan_activations(model, None, hardware=HW, plan_file=str(path), verbose=False)
    try:
        assert again.plan.block_modes == first.plan.block_modes and again.profile is None
    finally:
        again.close()
    with pytest.raises(ValueError, match="model states per rank"):
        plan_activations(model, None, hardware=HW, plan_file=str(path), verbose=False,
                         states=MegatronStates(params=1))
    with pytest.raises(ValueError, match="above the device memory given now"):
        plan_activations(model, None, hardware=HW, plan_file=str(path), verbose=False,
                         device_memory=first.plan.prediction.peak_device_bytes)
    longer = batch(seq=2 * SEQ)
    with pytest.raises(ValueError, match=f"made for sequence length {SEQ}, this run's batches have {2 * SEQ}"):
        plan_activations(model, longer, hardware=HW, plan_file=str(path), verbose=False)
    with pytest.raises(ValueError, match="could not be saved there .*exists and is not a directory"):
        plan_activations(model, sample, hardware=HW, plan_file=str(path / "plan.json"), verbose=False)


def test_bad_input_is_refused_with_the_fix(model, sample):
    with pytest.raises(ValueError, match="only n_checkpoint, n_swap, n_ssd, n_selective can be pinned"):
        _plan(model, sample, pins={"n_persist": 1})
    with pytest.raises(ValueError, match="needs an SSD path"):
        _plan(model, sample, pins={"n_ssd": 1})
    with pytest.raises(ValueError, match="pin them to 0"):
        _plan(model, sample, pins={"n_swap": 1}, in_flight_microbatches=2)
    with pytest.raises(ValueError, match="needs a sample batch"):
        plan_activations(model, None, hardware=HW, verbose=False)
    swap = _plan(model, sample, pins={"n_checkpoint": 0, "n_swap": 1})
    swap.close()
    with pytest.raises(ValueError, match="pipeline parallelism keeps several"):
        ActivationPolicy(model, swap.plan, pipeline_parallel=2)


def test_pipeline_stage_plans_for_micro_batches_in_flight(model, sample):
    from protrain_megatron.apply import profile_megatron
    profile = profile_megatron(model, sample, device=torch.device("cpu"), progress=False)
    one = _plan(model, None, profile=profile, pins={"n_checkpoint": 0, "n_swap": 0})
    one.close()
    four = _plan(model, None, profile=profile, pins={"n_checkpoint": 0}, in_flight_microbatches=4)
    four.close()
    assert four.plan.knobs.n_swap == 0 and four.plan.knobs.n_ssd == 0
    assert four.plan.prediction.activation_peak_bytes == 4 * one.plan.prediction.activation_peak_bytes
    assert any("in flight" in n for n in four.plan.notes)


def test_states_from_megatron_arguments():
    from types import SimpleNamespace as NS
    bf16 = NS(bf16=True, fp16=False, accumulate_allreduce_grads_in_fp32=True,
              use_distributed_optimizer=True, data_parallel_size=8)
    s = MegatronStates.from_args(bf16, 10**9)
    assert (s.param_bytes, s.grad_bytes, s.optimizer_bytes, s.optimizer_shards) == (2, 4, 12, 8)
    assert s.total_bytes == 10**9 * 6 + 10**9 * 12 // 8
    # Context parallelism: the distributed optimizer shards over data x context parallel ranks.
    cp = MegatronStates.from_args(NS(bf16=True, fp16=False, use_distributed_optimizer=True,
                                     data_parallel_size=2, context_parallel_size=4), 10**9)
    assert cp.optimizer_shards == 8 and cp.total_bytes == s.total_bytes
    assert MegatronStates.from_args(NS(bf16=True, context_parallel_size=4), 10).optimizer_shards == 1
    fp32 = MegatronStates.from_args(NS(bf16=False, fp16=False), 100)
    assert fp32.total_bytes == 100 * (4 + 4 + 8)
    with pytest.raises(ValueError, match="optimizer_shards"):
        MegatronStates(params=1, optimizer_shards=0)


def _two_ranks(tmp_path, mode, pins):
    import json
    return two_ranks("megatron_worker.py", tmp_path, json.dumps(pins), mode)


def test_tensor_parallel_ranks_profile_together_and_apply_rank0s_plan(tmp_path, model):
    results = _two_ranks(tmp_path, "tp", {"n_checkpoint": 1, "n_swap": 2})
    full = sum(p.numel() for p in model.parameters())
    for r in results:
        # Both ranks measured their shard (a rank-0-only profile would hang the TP collectives),
        # run rank 0's plan, and get the gradients of the run without a policy.
        assert r["profiled"] and r["modes"] == "SSCN"
        assert r["reloaded_modes"] == "SSCN" and not r["reprofiled"]
        assert r["loss_equal"] and r["grads_equal"]
        assert r["state_params"] == r["params"] < full     # model states counted per rank
    # Rank 0's plan file refused: rank 0 raises its error, rank 1 the same, naming its decider.
    mine, peer = (r["refused"] for r in sorted(results, key=lambda r: r["rank"]))
    assert mine.startswith("ValueError: plan file ") and "model states per rank" in mine
    assert peer == f"InfeasibleError: protrain (rank 0, which plans for this rank): {mine[len('ValueError: '):]}"


def test_an_out_of_memory_on_one_tensor_parallel_rank_makes_every_rank_fall_back(tmp_path):
    """Rank 1's profile runs out of memory, rank 0's does not: both plan from the fallback
    profile (rank 0 decides), so no rank plans from a profile another could not run."""
    results = _two_ranks(tmp_path, "tp-oom", {"n_checkpoint": 1, "n_swap": 2})
    for r in results:
        assert any("did not fit" in n for n in r["notes"]), r["notes"]
        assert r["modes"] == "SSCN" and r["loss_equal"] and r["grads_equal"]


def test_pipeline_stages_measure_and_plan_their_own_layers(tmp_path):
    first, last = _two_ranks(tmp_path, "pp", {"n_checkpoint": 1})
    assert first["layers"] == "1 recompute, 2 keep" and last["layers"] == "3 recompute, 4 keep"
    assert first["source"] == last["source"] == "measured"
    assert any("2 micro-batches in flight" in n for n in first["notes"])
    assert any("1 micro-batch in flight" in n for n in last["notes"])
    for r in (first, last):
        assert r["loss_equal"] and r["grads_equal"]


def test_profiling_out_of_memory_falls_back(monkeypatch, model, sample):
    import protrain_megatron.apply as apply_mod

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    real = apply_mod.profile_megatron
    measured = real(model, sample, device=torch.device("cpu"), progress=False)
    monkeypatch.setattr(apply_mod, "profile_megatron", oom)
    with pytest.raises(torch.OutOfMemoryError):
        _plan(model, sample)
    applied = _plan(model, sample, fallback_profile=lambda: measured)
    applied.close()
    assert applied.profile is measured
    assert any("did not fit" in n for n in applied.plan.notes)


def test_stage_profile_per_tensor_parallel_rank(monkeypatch):
    from types import SimpleNamespace as NS

    from protrain_megatron.stage_profile import REPLICATED_SHARE, stage_profile
    monkeypatch.setattr("protrain.measure.probe.probe_hardware", lambda **k: HW)
    args = NS(hidden_size=1024, num_attention_heads=16, padded_vocab_size=32000, seq_length=2048,
              micro_batch_size=2, swiglu=False, group_query_attention=False, ffn_hidden_size=4096,
              untie_embeddings_and_output_weights=False, max_position_embeddings=2048, bf16=True,
              sequence_parallel=False)
    one = stage_profile(args, 6, {"tp": 1, "cp": 1, "pp_rank": 0})
    tp4 = stage_profile(args, 6, {"tp": 4, "cp": 1, "pp_rank": 0})
    args.sequence_parallel = True
    sp4 = stage_profile(args, 6, {"tp": 4, "cp": 1, "pp_rank": 0})
    a, b, c = (p.blocks[0].saved_bytes for p in (one, tp4, sp4))
    assert one.n_blocks == 6
    assert b == pytest.approx(a * (REPLICATED_SHARE + (1 - REPLICATED_SHARE) / 4), rel=1e-6)
    assert c == pytest.approx(a / 4, rel=1e-6)
    assert tp4.blocks[0].fwd_time == pytest.approx(one.blocks[0].fwd_time / 4)


def test_megatron_core_example_trains_with_a_plan(tmp_path):
    import os
    import re
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "megatron_core_gpt.py")
    env = dict(os.environ, MASTER_PORT=str(free_port()), PROTRAIN_CACHE=str(tmp_path))
    p = subprocess.run([sys.executable, script, "--steps", "12", "--pin", "n_swap=1", "--pin", "n_checkpoint=1",
                        "--layers", "3", "--hidden", "128", "--seq", "64"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "layers (global numbers): 1 swap to host, 2 recompute, 3 keep" in p.stdout
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", p.stdout).groups())
    assert last < first


def test_bf16_float16module_with_accumulation(tmp_path):
    """As Megatron-LM runs it: the GPTModel inside Float16Module (bf16), two micro-batches
    accumulated per step; a mixed plan (NVMe, swap, recompute, keep) gives the same bits."""
    from megatron.core.transformer.module import Float16Module
    model = gpt(num_layers=4, hidden=128, seq=SEQ, seed=3)
    model.config.bf16 = True
    wrapped = Float16Module(model.config, model)
    micro = [batch(seq=SEQ, seed=s) for s in (11, 12)]

    def step():
        torch.manual_seed(7)
        wrapped.zero_grad(set_to_none=True)
        losses = []
        for mb in micro:
            loss = wrapped(mb["input_ids"], mb["position_ids"], None, labels=mb["labels"]).float().mean()
            (loss / len(micro)).backward()
            losses.append(loss.detach())
        return losses, {n: p.grad.clone() for n, p in wrapped.named_parameters()}

    ref_losses, ref_grads = step()
    assert next(model.parameters()).dtype == torch.bfloat16
    applied = _plan(wrapped, micro[0], pins={"n_ssd": 1, "n_swap": 1, "n_checkpoint": 1},
                    ssd_path=str(tmp_path))
    try:
        assert applied.policy.core is model
        assert applied.states.param_bytes == 2
        losses, grads = step()
    finally:
        applied.close()
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    for n, g in grads.items():
        assert torch.equal(g, ref_grads[n]), n


def test_fp8_models_get_native_recompute_only(model, sample):
    model.config.fp8 = "hybrid"           # what the plan reads; nothing runs in FP8 on CPU
    try:
        applied = _plan(model, sample, pins={"n_checkpoint": 2}, prefer_native=False)
        applied.close()
        assert "".join(m.letter for m in applied.plan.block_modes) == "CCNN"
        assert applied.policy.native and any("FP8" in n for n in applied.plan.notes)
        with pytest.raises(ValueError, match="only keep / recompute"):
            _plan(model, sample, pins={"n_swap": 1})
        with pytest.raises(ValueError, match="trains in FP8"):
            ActivationPolicy(model, replace_modes(applied.plan, "CNCN"))
    finally:
        model.config.fp8 = None


def replace_modes(plan, letters):
    from dataclasses import replace
    by = {m.letter: m for m in BlockMode}
    return replace(plan, block_modes=tuple(by[c] for c in letters))


def test_host_memory_is_shared_by_the_ranks_on_a_host(monkeypatch, model, sample):
    import protrain_megatron.apply as apply_mod
    monkeypatch.setattr(apply_mod, "_ranks_per_node", lambda: 4)
    applied = _plan(model, sample, pins={"n_checkpoint": 0, "n_swap": 4})
    applied.close()
    assert applied.plan.host_memory == HW.host_memory // 4
    assert any("shared by 4 ranks" in n for n in applied.plan.notes)
    monkeypatch.setattr(apply_mod, "_ranks_per_node", lambda: 4096)
    with pytest.raises(InfeasibleError):          # 1 GiB / 4096 cannot hold the swapped layers
        _plan(model, sample, pins={"n_checkpoint": 0, "n_swap": 4})


def test_cuda_graphs_refuse_hook_plans(model, sample):
    swap = _plan(model, sample, pins={"n_checkpoint": 0, "n_swap": 1})
    swap.close()
    model.config.cuda_graph_impl = "local"
    try:
        with pytest.raises(ValueError, match="runs CUDA graphs"):
            ActivationPolicy(model, swap.plan)
        ckpt = _plan(model, sample, pins={"n_checkpoint": 1}, prefer_native=False)
        ckpt.close()
        assert ckpt.policy.native and ckpt.plan.knobs.n_swap == 0      # planned for Megatron's own
        assert any("CUDA graphs" in n for n in ckpt.plan.notes)
    finally:
        model.config.cuda_graph_impl = "none"


def test_native_recompute_is_preferred_despite_timing_noise():
    """Megatron's native recompute (first layers) against ProTrain's interleaved layout for the
    same count: layers of one shape do the same FLOPs, so a spread in their measured times
    (30% here) must not decide (it made CI pick ``CNCN`` once); a layer that is really dearer
    to recompute still does."""
    from dataclasses import replace as dc_replace

    from protrain.config import KnobPins, PlannerConfig
    from protrain.profile.analytic import ModelShape, analytic_profile
    from protrain.search import search
    from protrain_megatron.apply import _prefer_native

    shape = ModelShape("four", "gpt2", n_layers=4, hidden=256, heads=4, vocab=2048, seq_len=256,
                       micro_batch=4, max_positions=256)
    base = analytic_profile(shape, dc_replace(HW, peak_flops=1e11))
    config = PlannerConfig(pins=KnobPins(n_checkpoint=2, n_swap=0, n_ssd=0), cpu_optim_overlap=False)

    def slower(profile, i, factor, **shape_change):
        parts = list(profile.parts)
        b = profile.block_part_indices[i]
        parts[b] = dc_replace(parts[b], fwd_time=parts[b].fwd_time * factor,
                              bwd_time=parts[b].bwd_time * factor, **shape_change)
        return dc_replace(profile, parts=tuple(parts))

    noisy = slower(base, 1, 1.3)                # layer 2 measured 30% slow: noise
    plan = search(noisy, HW, config)
    assert "".join(m.letter for m in plan.block_modes) == "CNCN"
    native = _prefer_native(plan, noisy, HW, config)
    assert "".join(m.letter for m in native.block_modes) == "CCNN"

    dearer = slower(base, 1, 3.0, saved_bytes=base.blocks[1].saved_bytes * 2)   # another kind
    plan = search(dearer, HW, config)
    kept = _prefer_native(plan, dearer, HW, config)
    assert "".join(m.letter for m in kept.block_modes) == "CNCN"

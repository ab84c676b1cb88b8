"""Plan value: exact JSON round trip, explain table, replay of saved knobs."""
import json
from dataclasses import replace

import pytest

from protrain.block_mode import BlockMode, layout_block_modes, modes_string
from protrain.config import PlannerConfig
from protrain.plan import Plan
from protrain.profile.analytic import PRESETS, analytic_profile
from protrain.profile.machines import machine
from protrain.search import InfeasibleError, evaluate, search
from protrain.units import GiB


@pytest.fixture(scope="module")
def plan():
    hw = machine("h100-80gb").profile(host_memory=128 * GiB)
    prof = analytic_profile(replace(PRESETS["llama2-7b"], micro_batch=4), hw)
    return search(prof, hw), prof, hw


def test_json_round_trip_is_exact(plan, tmp_path):
    p = plan[0]
    p.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == p
    assert json.loads((tmp_path / "plan.json").read_text()) == p.to_dict()
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_explain_names_knobs_replaced_knobs_predictions_and_runner_ups(plan):
    p = plan[0]
    text = p.explain()
    for s in ("chunk_size", "n_persist", "n_buffer", "n_checkpoint", "n_swap",
              "offload_param", "stage3_max_live_parameters", "activation_checkpointing",
              "--recompute-granularity", "predicted: iteration", "peak device memory",
              "runner-ups", modes_string(p.block_modes)):
        assert s in text, s
    assert len(p.alternatives) == 3
    # the chosen plan is the fastest, or within the time tolerance of it (the hedge says so)
    band = 1.0 + PlannerConfig().time_tolerance
    assert all(a.iter_time * band >= p.prediction.iter_time for a in p.alternatives)
    if any(a.iter_time < p.prediction.iter_time for a in p.alternatives):
        assert "hedged" in text


def test_evaluate_replays_saved_knobs(plan, tmp_path):
    """A plan saved to JSON and loaded, replayed on a profile built again from scratch (another
    object, not the one the search used) predicts the same; the search's own result holds by
    construction, this does not."""
    p, prof, hw = plan
    p.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    rebuilt = analytic_profile(replace(PRESETS["llama2-7b"], micro_batch=4),
                               machine("h100-80gb").profile(host_memory=128 * GiB))
    assert rebuilt is not prof
    again = evaluate(rebuilt, hw, loaded.knobs)
    assert again.prediction == loaded.prediction == p.prediction
    assert again.block_modes == loaded.block_modes
    # The replay does depend on the profile: another micro-batch predicts another peak.
    other = analytic_profile(replace(PRESETS["llama2-7b"], micro_batch=2), hw)
    assert evaluate(other, hw, loaded.knobs).prediction.peak_device_bytes < p.prediction.peak_device_bytes
    small = replace(hw, device_memory=20 * GiB)
    with pytest.raises(InfeasibleError, match="are available"):
        evaluate(prof, small, p.knobs, check_fit=True)


def test_block_layout_rule():
    # swap first, checkpoint interleaved over the rest, last block kept
    assert modes_string(layout_block_modes(8, 2, 3)) == "SSCNCNCN"
    # SSD blocks first, then swapped, then checkpoints over the rest (the last one kept)
    assert modes_string(layout_block_modes(8, 2, 3, 2)) == "DDSSCCCN"
    assert modes_string(layout_block_modes(4, 0, 4)) == "CCCC"
    assert layout_block_modes(3, 0, 0) == (BlockMode.NONE,) * 3
    with pytest.raises(ValueError):
        layout_block_modes(3, 2, 2)


def test_plan_rejects_modes_that_do_not_match_the_knobs(plan):
    p = plan[0]
    # The same counts in another order are a valid plan (Megatron's native recompute runs the
    # checkpointed blocks first); other counts are not.
    assert replace(p, block_modes=tuple(reversed(p.block_modes))).block_modes == tuple(reversed(p.block_modes))
    wrong = BlockMode.SWAP if p.block_modes[0] != BlockMode.SWAP else BlockMode.NONE
    with pytest.raises(ValueError, match="do not hold"):
        replace(p, block_modes=(wrong,) + p.block_modes[1:])


def test_vectorized_layout_equals_the_rule():
    import numpy as np
    from protrain.block_mode import layout_codes
    for n in range(1, 11):
        trip = [(ns, nc, nd) for nd in range(n + 1) for nc in range(n + 1) for ns in range(n + 1)
                if ns + nc + nd <= n]
        got = layout_codes(n, [t[0] for t in trip], [t[1] for t in trip], [t[2] for t in trip])
        want = np.array([[m.code for m in layout_block_modes(n, *t)] for t in trip], dtype=np.int8)
        assert np.array_equal(got, want), n


def test_small_models_are_counted_in_thousands_and_millions():
    from conftest import chain_profile
    prof = chain_profile(block_params=(400_000, 400_000), pre_params=75_000)
    assert prof.total_params == 875_000
    assert "875 k params" in prof.describe() and "B params" not in prof.describe()
    assert "124 M params" in analytic_profile(PRESETS["gpt2-small"], machine("h100-80gb").profile()).describe()

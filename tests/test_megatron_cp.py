"""AutoSP for Megatron: ``--protrain-auto-memory`` chooses the context-parallel degree (CP)
right after Megatron-LM parses its arguments, and context parallelism runs on plain
megatron-core through ProTrain's all-to-all attention.

- Two gloo ranks (tests/megatron_cp_worker.py): at a device budget where CP=1 does not fit
  the planner picks CP=2, and the CP=2 model (Megatron's zig-zag sequence split, learned
  positions, the local layer spec with its attention swapped) gives the loss and every
  gradient of CP=1 on the same batch; with an activation plan (the selective mode, a mixed
  plan) on top the gradients are those of CP=2 without one, bit for bit, and a selective
  layer's backward issues no all-to-all of its forward again.
- The same two ranks probe the machine as at argument parsing, at once: once per node (one
  measures under the probe's lock, the other reads its figures), one cache entry keyed on the
  threads and the 2 ranks per node.
- One process: the argument-parsing hook with Megatron-LM's flags: chosen, pinned, refused,
  ``--cp-comm-type a2a`` with Transformer Engine.
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cpu import two_ranks  # noqa: E402

from protrain.profile.hardware import HardwareProfile  # noqa: E402
from protrain.search import InfeasibleError  # noqa: E402
from protrain_megatron import context_parallel  # noqa: E402
from protrain_megatron.arguments import MegatronOptions, add_protrain_arguments  # noqa: E402
from protrain_megatron.context_parallel import choose_context_parallel  # noqa: E402
from protrain_megatron.training import choose_after_parsing  # noqa: E402

HW = HardwareProfile(name="cpu-test", source="measured", device_type="cpu", device_memory=2**30,
                     host_memory=2**30, h2d_bandwidth=1e9, d2h_bandwidth=1e9, gpu_adam_rate=1e9,
                     cpu_adam_rate=1e8, collective_bandwidth=1e9)
"""The worker's machine figures (fixed: the choice must not depend on this machine's load)."""


def _assert_close(ref, got, rel=1e-5):
    assert set(ref) == set(got)
    for name in ref:
        a, b = torch.tensor(ref[name]), torch.tensor(got[name])
        assert a.shape == b.shape, name
        scale = a.abs().max().item()
        assert scale > 0, name               # every parameter gets a gradient
        assert (a - b).abs().max().item() <= rel * scale, name


PLANS = ({"n_checkpoint": 0, "n_swap": 0, "n_selective": 4}, {"n_checkpoint": 1, "n_swap": 1, "n_selective": 1})


def test_the_planner_picks_cp2_and_it_trains_like_cp1(tmp_path):
    # One key/value head for two CP ranks: replicated before the all-to-all.
    results = two_ranks("megatron_cp_worker.py", tmp_path, json.dumps({"kv_heads": 1, "plans": PLANS}))
    for r in results:
        # The budget is one byte below CP=1's leanest plan, which CP=2 undercuts.
        assert r["needs"]["2"] < r["needs"]["1"]
        assert r["chosen"] == 2
        assert any(line.startswith("CP=1 does not fit: needs") for line in r["reasons"])
        assert any(line.startswith("CP=2:") and line.endswith("- chosen") for line in r["reasons"])
        assert r["disagreement"] and "different context-parallel sizes (1 to 2" in r["disagreement"]
        assert r["attention"] == "SDPACoreAttention"     # Megatron's local attention refuses CP
        ref_loss, ref_grads = r["ref"]
        cp_loss, cp_grads = r["cp"]
        assert cp_loss == pytest.approx(ref_loss, rel=1e-5)
        _assert_close(ref_grads, cp_grads)
        # Backward issues an all-to-all for the gradient of each forward one (4 per layer:
        # q, k, v, output).
        assert r["a2a_backward"] == 4 * 4
        assert [p["modes"] for p in r["plans"]] == ["AAAA", "SCAN"]
        for planned in r["plans"]:
            # An activation plan under CP changes nothing numerically; a recomputed (C) layer
            # issues its 4 forward all-to-alls again, a selective (A) layer none: their
            # outputs were kept.
            assert planned["run"] == [cp_loss, cp_grads]
            assert planned["a2a_backward"] - r["a2a_backward"] == 4 * planned["modes"].count("C")
    assert results[0]["ref"] == results[1]["ref"] and results[0]["cp"] == results[1]["cp"]
    _probed_once_per_node(tmp_path, results)


def _probed_once_per_node(tmp_path, results):
    from protrain.measure.probe import cache_key
    from protrain.runtime.node import node_cores
    log = [json.loads(line) for line in (tmp_path / "measured.log").read_text().splitlines()]
    assert len(log) == 1                                # one measurement for the node
    measured = log[0]
    waited = results[1 - measured["rank"]]["probe"]
    assert waited["start"] < measured["end"] <= waited["end"]     # on the lock, then read it
    got = [{k: v for k, v in r["probe"]["hw"].items() if k not in ("device_memory", "host_memory")}
           for r in results]
    assert got[0] == got[1] and got[0]["ranks_per_node"] == 2
    entries = list((tmp_path / "probe-cache").glob("hardware-*.json"))
    assert len(entries) == 1 and cache_key(torch.device("cpu"), node_cores(), 2) in entries[0].name
    assert not list((tmp_path / "probe-cache").glob("*.tmp"))


# -- the argument-parsing hook, one process ------------------------------------------------


def _megatron_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of Megatron-LM's parser that the choice reads (their defaults as there)."""
    p.add_argument("--num-layers", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-attention-heads", type=int)
    p.add_argument("--group-query-attention", action="store_true")
    p.add_argument("--num-query-groups", type=int, default=1)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--max-position-embeddings", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int)
    p.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
    p.add_argument("--transformer-impl", default="transformer_engine")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--bf16", action="store_true")
    return add_protrain_arguments(p)


def _megatron_parser():
    """What Megatron-LM's parse_args gets with the start-up hook: its flags, the ProTrain
    group, the choice made right after parsing."""
    return choose_after_parsing(_megatron_flags(argparse.ArgumentParser(allow_abbrev=False)))


MODEL = ["--protrain-auto-memory", "--num-layers", "4", "--hidden-size", "128",
         "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
         "--micro-batch-size", "2", "--vocab-size", "128", "--transformer-impl", "local"]


def _need(cp, extra=(), world=2):
    """Device bytes the leanest plan at ``cp`` needs (the planner's own figure)."""
    ns = _megatron_flags(argparse.ArgumentParser()).parse_args(
        MODEL + list(extra) + ["--context-parallel-size", str(cp)])
    with pytest.raises(InfeasibleError) as e:
        choose_context_parallel(ns, MegatronOptions(device_memory=2**20), world=world, pinned=True,
                                hardware=HW)
    return e.value.device_needed


@pytest.fixture
def launch(monkeypatch):
    """Parse ``argv`` as rank 0 of ``world`` ranks, before any process group exists."""
    monkeypatch.setattr(context_parallel, "parse_time_hardware", lambda: HW)
    from megatron.core import parallel_state as ps
    monkeypatch.setattr(ps, "initialize_model_parallel", ps.initialize_model_parallel)  # restored after

    def parse(argv, world=2, te=False):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setattr(context_parallel, "transformer_engine_used", lambda args: te)
        return _megatron_parser().parse_args(argv)
    return parse


def test_parsing_chooses_cp_where_cp1_does_not_fit(launch, capsys):
    need1, need2 = _need(1), _need(2)
    assert need2 < need1
    budget = ["--protrain-device-memory", str(need1 - 1)]
    args = launch(MODEL + budget)
    out = capsys.readouterr().out
    assert args.context_parallel_size == 2 and args.protrain_cp_choice == 2
    assert args.cp_comm_type == ["p2p"]                  # no Transformer Engine: ours does the a2a
    assert "ProTrain: --context-parallel-size 2 (chosen by ProTrain)" in out
    assert "CP=1 does not fit: needs" in out and "- chosen" in out
    assert "attention through ProTrain's all-to-all" in out
    # Room for CP=1: the fastest degree is chosen, and the line for each degree says why.
    roomy = launch(MODEL + ["--protrain-device-memory", "1GiB"])
    reasons = capsys.readouterr().out
    assert roomy.context_parallel_size in (1, 2)
    assert f"CP={roomy.context_parallel_size}: step" in reasons and "CP=1: step" in reasons
    # One rank per tensor x pipeline group: nothing to choose, nothing probed or printed.
    context_parallel.parse_time_hardware = None          # (restored by the fixture)
    single = launch(MODEL + budget, world=1)
    assert single.context_parallel_size == 1 and not hasattr(single, "protrain_cp_choice")
    assert "context-parallel-size" not in capsys.readouterr().out
    # Without the flag nothing is chosen.
    plain = launch([a for a in MODEL if a != "--protrain-auto-memory"] + budget)
    assert plain.context_parallel_size == 1 and not hasattr(plain, "protrain_cp_choice")


def test_transformer_engine_gets_the_all_to_all_unless_the_user_chose(launch, capsys):
    budget = ["--protrain-device-memory", str(_need(1) - 1)]
    te = launch(MODEL[:-2] + budget, te=True)
    assert te.context_parallel_size == 2 and te.cp_comm_type == ["a2a"]
    assert "--cp-comm-type a2a" in capsys.readouterr().out
    theirs = launch(MODEL[:-2] + budget + ["--cp-comm-type", "p2p"], te=True)
    assert theirs.context_parallel_size == 2 and theirs.cp_comm_type == ["p2p"]


def test_the_users_cp_is_a_pin(launch, capsys):
    args = launch(MODEL + ["--protrain-device-memory", "1GiB", "--context-parallel-size", "2"])
    assert args.context_parallel_size == 2
    assert "--context-parallel-size 2 (pinned by the command line)" in capsys.readouterr().out
    args = launch(MODEL + ["--protrain-device-memory", "1GiB", "--context-parallel-size=1"])
    assert args.context_parallel_size == 1
    # A pin that does not fit is not changed: the run stops saying what it needs.
    with pytest.raises(SystemExit, match=r"CP=1 does not fit: needs .* of device memory"):
        launch(MODEL + ["--protrain-device-memory", str(_need(1) - 1), "--context-parallel-size", "1"])


@pytest.mark.parametrize("extra,world,message", [
    (["--context-parallel-size", "3"], 4,
     r"--context-parallel-size = 3: CP must divide the ranks per tensor x pipeline parallel group "
     r"\(4 ranks / \(TP 1 x PP 1\) = 4\); CP must divide the attention head count \(4 heads\).*"
     r"Valid values here: 1, 2, 4 \(or leave --context-parallel-size out"),
    (["--context-parallel-size", "4", "--tensor-model-parallel-size", "2"], 8,
     r"CP must divide the attention head count \(2 heads\).*Valid values here: 1, 2 "),
    (["--context-parallel-size", "2", "--seq-length", "66", "--max-position-embeddings", "66"], 2,
     r"2 x CP must divide the sequence length \(66 tokens\).*Valid values here: 1 "),
    (["--context-parallel-size", "2", "--group-query-attention", "--num-query-groups", "3",
      "--num-attention-heads", "6", "--hidden-size", "96"], 2,
     r"the KV-head rule: kv_heads % CP == 0 or CP % kv_heads == 0 \(3 KV heads\)"),
    (["--tensor-model-parallel-size", "2"], 3,
     r"WORLD_SIZE 3 is not divisible by --tensor-model-parallel-size 2"),
])
def test_a_pinned_cp_that_breaks_a_constraint_is_refused(launch, extra, world, message):
    with pytest.raises(SystemExit, match=message):
        launch(MODEL + ["--protrain-device-memory", "1GiB"] + extra, world=world)


def test_transformer_engines_all_to_all_needs_whole_kv_heads(launch):
    gqa = ["--group-query-attention", "--num-query-groups", "1", "--context-parallel-size", "2"]
    assert launch(MODEL + ["--protrain-device-memory", "1GiB"] + gqa).context_parallel_size == 2
    with pytest.raises(SystemExit, match=r"CP must divide the key/value heads \(1\) for Transformer "
                                         r"Engine's all-to-all"):
        launch(MODEL[:-2] + ["--protrain-device-memory", "1GiB"] + gqa, te=True)


def test_no_model_shape_no_choice(launch):
    with pytest.raises(SystemExit, match="needs the model's shape to choose --context-parallel-size: "
                                         "set --num-layers"):
        launch(["--protrain-auto-memory", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "64", "--micro-batch-size", "1"])


def test_link_figures_before_the_ranks_are_connected():
    from dataclasses import replace

    from protrain.profile.machines import MACHINES, machine_for_device
    from protrain_megatron.context_parallel import with_link_figures
    assert machine_for_device("NVIDIA H100 80GB HBM3") is MACHINES["h100-80gb"]
    assert machine_for_device("NVIDIA H100 PCIe") is MACHINES["h100-pcie-80gb"]
    assert machine_for_device("NVIDIA A100-SXM4-40GB") is MACHINES["a100-40gb"]
    assert machine_for_device("NVIDIA A100 80GB PCIe") is None
    # Measured figures stay (the all-to-all takes the collectives' when only they are known).
    same, how = with_link_figures(HW)
    assert how is None and same.alltoall_bandwidth == same.collective_bandwidth == HW.collective_bandwidth
    bare = replace(HW, collective_bandwidth=0.0, alltoall_bandwidth=0.0)
    gpu, how = with_link_figures(replace(bare, name="NVIDIA H100 80GB HBM3", device_type="cuda"))
    assert gpu.alltoall_bandwidth == gpu.collective_bandwidth == MACHINES["h100-80gb"].collective_bandwidth
    assert "360.0 GB/s assumed (the published figure of h100-80gb)" in how
    host, how = with_link_figures(replace(bare, h2d_bandwidth=3e9, d2h_bandwidth=2e9))
    assert host.alltoall_bandwidth == host.collective_bandwidth == 2e9
    assert "2.0 GB/s assumed (the host link's measured copy bandwidth; no published figure for cpu-test)" in how
    # The choice says which figure it planned with.
    ns = _megatron_flags(argparse.ArgumentParser()).parse_args(MODEL)
    choice = choose_context_parallel(ns, MegatronOptions(device_memory=2**30), world=2, pinned=False,
                                     hardware=replace(bare, h2d_bandwidth=3e9, d2h_bandwidth=2e9))
    assert any("2.0 GB/s assumed" in r for r in choice.reasons)

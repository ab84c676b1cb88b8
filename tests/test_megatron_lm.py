"""--protrain-auto-memory in Megatron-LM: the argument group, the get_model wrapper (driven
with a CPU megatron-core model), the start-up hook's gating, and - a manual check, skipped in
CI - Megatron-LM's real parse_args in a fresh interpreter, when a Megatron-LM (core_v0.16.1)
source tree is given in MEGATRON_LM_PATH. CI cannot run it: Megatron-LM's training package
(megatron.training) is not published on PyPI, whose megatron-core wheel and sdist hold only
megatron.core."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cpu import cpu_rng_states, gpt  # noqa: E402

from protrain_megatron import autoload, training  # noqa: E402
from protrain_megatron.arguments import MegatronOptions, add_protrain_arguments, take_over_flags  # noqa: E402

from test_megatron import HW  # noqa: E402


def _parse(argv):
    return add_protrain_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_argument_group_and_options():
    args = _parse(["--protrain-auto-memory", "--protrain-device-memory", "70GiB",
                   "--protrain-pin", "n_swap=0", "--protrain-pin", "n_checkpoint=3",
                   "--protrain-ssd-path", "/nvme", "--protrain-plan-file", "p.json"])
    o = MegatronOptions.from_args(args)
    assert o.device_memory == 70 * 2**30 and o.pins == (("n_swap", 0), ("n_checkpoint", 3))
    assert (o.ssd_path, o.plan_file, o.memory_margin) == ("/nvme", "p.json", 0.10)
    assert _parse([]).protrain_auto_memory is False


@pytest.mark.parametrize("argv,message", [
    (["--protrain-device-memory", "lots"], "--protrain-device-memory: cannot read 'lots'"),
    (["--protrain-pin", "n_persist=2"], "use KNOB=N with KNOB one of n_checkpoint, n_swap, n_ssd, n_selective"),
    (["--protrain-pin", "n_swap"], "use KNOB=N"),
    (["--protrain-memory-margin", "1.5"], "must be in \\[0, 1\\)"),
])
def test_bad_values_exit_naming_the_flag(argv, message):
    with pytest.raises(SystemExit, match=message):
        MegatronOptions.from_args(_parse(["--protrain-auto-memory"] + argv))


def test_replaced_flags_are_reported_and_reset():
    args = types.SimpleNamespace(recompute_granularity="full", recompute_method="uniform",
                                 recompute_num_layers=1, cpu_offloading=False, cpu_offloading_num_layers=0)
    assert take_over_flags(args) == ["--recompute-granularity / --recompute-activations full",
                                     "--recompute-method uniform", "--recompute-num-layers 1"]
    assert args.recompute_granularity is args.recompute_method is args.recompute_num_layers is None
    assert take_over_flags(args) == []


def test_start_up_hook_changes_nothing_without_the_flag(monkeypatch):
    def add(parser):
        return parser
    def get_model(provider, model_type=None, wrap_with_ddp=True):
        return provider
    mod = types.SimpleNamespace(add_megatron_arguments=add, get_model=get_model)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2"])
    autoload.install_arguments(mod)
    autoload.install_training(mod)
    assert mod.add_megatron_arguments is add and mod.get_model is get_model
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--protrain-auto-memory"])
    autoload.install_arguments(mod)
    autoload.install_training(mod)
    assert mod.add_megatron_arguments is not add and mod.get_model is not get_model
    parsed = mod.add_megatron_arguments(argparse.ArgumentParser()).parse_args(["--protrain-auto-memory"])
    assert parsed.protrain_auto_memory


def _megatron_args(**over):
    ns = _parse(["--protrain-auto-memory", "--protrain-device-memory", "1GiB"])
    for k, v in dict(micro_batch_size=2, seq_length=64, padded_vocab_size=128, vocab_size=128,
                     bf16=False, fp16=False, recompute_granularity="selective", recompute_method=None,
                     recompute_num_layers=None, cpu_offloading=False, cpu_offloading_num_layers=0,
                     context_parallel_size=1, create_attention_mask_in_dataloader=False).items():
        setattr(ns, k, v)
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


def test_get_model_wrapper_plans_and_applies(monkeypatch, capsys):
    cpu_rng_states(monkeypatch)
    monkeypatch.setattr("protrain_megatron.apply._probe", lambda device, verbose: HW)
    args = _megatron_args()
    args.protrain_pin = ["n_swap=2", "n_checkpoint=1"]
    seen = {}

    def original(provider, model_type=None, wrap_with_ddp=True):
        seen["granularity at build"] = args.recompute_granularity
        return [provider()]
    get_model = training.wrap_get_model(original, lambda: args)
    model = get_model(lambda: gpt(num_layers=4, hidden=128, seq=64), None, wrap_with_ddp=True)
    out = capsys.readouterr().out
    applied = training.APPLIED.pop()
    try:
        assert seen["granularity at build"] is None          # built without the replaced flag
        assert "the plan replaces --recompute-granularity / --recompute-activations selective" in out
        assert "ProTrain activation plan" in out and "1-2 swap to host" in out
        assert applied.plan.knobs.n_swap == 2 and applied.plan.knobs.n_checkpoint == 1
        assert applied.plan.device_memory == 2**30
        assert applied.policy.core is model[0]
        torch.manual_seed(0)
        ids = torch.randint(0, 128, (2, 64))
        loss = model[0](ids, torch.arange(64).expand(2, -1), None, labels=ids).float().mean()
        loss.backward()
        assert applied.policy.activations.stats["swapped_bytes"] > 0
    finally:
        applied.close()
    # Inference copies (wrap_with_ddp=False) and runs without the flag are left alone.
    args2 = _megatron_args(protrain_auto_memory=False)
    plain = training.wrap_get_model(original, lambda: args2)(lambda: "m", None, wrap_with_ddp=True)
    assert plain == ["m"] and args2.recompute_granularity == "selective"


def test_yaml_config_without_the_group_is_refused(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--yaml-cfg", "x.yaml", "--protrain-auto-memory"])
    get_model = training.wrap_get_model(lambda *a, **k: None, lambda: types.SimpleNamespace())
    with pytest.raises(SystemExit, match="--yaml-cfg replaces them"):
        get_model(lambda: None)


MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")
manual = pytest.mark.skipif(
    not MEGATRON_LM, reason="manual check: set MEGATRON_LM_PATH to a Megatron-LM (core_v0.16.1) "
    "source tree (megatron/training, megatron/legacy, megatron/rl; triton importable); its training "
    "code is not on PyPI")


@manual
def test_megatron_lm_parse_args_accepts_the_flag(tmp_path):
    script = textwrap.dedent("""
        import sys
        from megatron.training.arguments import parse_args
        import megatron.training.training as T
        args = parse_args()
        print("RESULT", getattr(args, "protrain_auto_memory", None), getattr(args, "protrain_pin", None),
              getattr(args, "protrain_device_memory", None), args.recompute_granularity,
              getattr(T.get_model, "_protrain", False))
    """)
    base = [sys.executable, "-c", script, "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
            "--micro-batch-size", "2"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MEGATRON_LM, os.environ.get("PYTHONPATH", "")]))
    run = lambda extra: subprocess.run(base + extra, env=env, capture_output=True, text=True,  # noqa: E731
                                       timeout=600, cwd=tmp_path)
    ok = run(["--protrain-auto-memory", "--protrain-pin", "n_swap=0", "--protrain-device-memory",
              "70GiB", "--recompute-granularity", "full"])
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "RESULT True ['n_swap=0'] 70GiB full True" in ok.stdout
    # Without the flag Megatron-LM is untouched: its strict parser refuses our options.
    plain = run(["--protrain-device-memory", "70GiB"])
    assert plain.returncode == 2 and "unrecognized arguments: --protrain-device-memory" in plain.stderr
    assert "RESULT None None None None False" in run([]).stdout


@manual
def test_megatron_lm_parse_args_chooses_the_context_parallel_size(tmp_path):
    """Megatron-LM's own parse_args, 2 ranks announced, a budget at which CP=1 does not fit:
    the parsed arguments carry CP=2 before validate_args; a user's CP is kept."""
    from test_megatron_cp import MODEL, _need
    script = textwrap.dedent("""
        from megatron.training.arguments import parse_args
        args = parse_args()
        print("RESULT", args.context_parallel_size, args.cp_comm_type)
    """)
    env = dict(os.environ, WORLD_SIZE="2", RANK="0",
               PYTHONPATH=os.pathsep.join([MEGATRON_LM, os.environ.get("PYTHONPATH", "")]))
    budget = ["--protrain-device-memory", str(_need(1) - 1)]
    run = lambda extra: subprocess.run([sys.executable, "-c", script] + MODEL + budget + extra,  # noqa: E731
                                       env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    chosen = run([])
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    assert "RESULT 2 ['p2p']" in chosen.stdout
    assert "ProTrain: --context-parallel-size 2 (chosen by ProTrain)" in chosen.stdout
    assert "CP=1 does not fit" in chosen.stdout
    pinned = run(["--context-parallel-size", "1"])
    assert pinned.returncode != 0 and "CP=1 does not fit" in pinned.stderr
    roomy = subprocess.run([sys.executable, "-c", script] + MODEL + ["--protrain-device-memory", "1GiB",
                                                                     "--context-parallel-size", "1"],
                           env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert roomy.returncode == 0 and "RESULT 1 ['p2p']" in roomy.stdout
    assert "(pinned by the command line)" in roomy.stdout


def test_pipeline_stage_plans_for_its_micro_batches_in_flight(monkeypatch, tmp_path):
    cpu_rng_states(monkeypatch)
    sizes = {"tp": 1, "pp": 2, "dp": 1, "cp": 1, "pp_rank": 0, "dp_rank": 0}
    monkeypatch.setattr("protrain_megatron.training.parallel_sizes", lambda: sizes)
    monkeypatch.setattr("protrain_megatron.apply.parallel_sizes", lambda: sizes)
    monkeypatch.setattr("megatron.core.num_microbatches_calculator.get_num_microbatches", lambda: 8)
    monkeypatch.setattr("protrain_megatron.apply._probe", lambda device, verbose: HW)
    args = _megatron_args()
    args.protrain_plan_file = str(tmp_path / "plan.json")
    model = [gpt(num_layers=4, hidden=128, seq=64)]
    applied = training.apply_to_megatron_lm(model, args, MegatronOptions.from_args(args))
    try:
        plan = applied.plan
        assert plan.profile_source == "measured"
        assert plan.knobs.n_swap == 0 and plan.knobs.n_ssd == 0
        assert any("2 micro-batches in flight" in n for n in plan.notes)
        # The first of 2 stages holds 2 micro-batches: twice the measured activations.
        assert plan.block_saved_bytes[0] == 2 * applied.profile.blocks[0].saved_bytes
        assert (tmp_path / "plan.stage0.json").exists()      # one plan file per stage
    finally:
        applied.close()

"""`protrain` command line: plans for the issue's models in under 2 s, actionable failures."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from protrain.plan import Plan


def protrain(*args, env=None, timeout=600):
    cmd = [sys.executable, "-m", "protrain.cli", *args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    return r, time.perf_counter() - t0


@pytest.mark.parametrize("model, mb", [("gpt2-1.5b", 8), ("llama2-7b", 4), ("llama2-13b", 4)])
def test_plans_on_an_80gb_gpu_with_128gib_host_in_well_under_a_second(model, mb, tmp_path):
    r, seconds = protrain("plan", "--model", model, "--micro-batch", str(mb), "--seq", "1024",
                          "--gpu", "h100-80gb", "--host-memory", "128GiB", "--save",
                          str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    assert f"ProTrain plan for {model}" in r.stdout and "predicted: iteration" in r.stdout
    # The search's own time (tens of ms); the process around it imports torch, whose start-up
    # on a loaded 2-core machine is what varies.
    assert Plan.load(tmp_path / "p.json").search_seconds < 1.0
    assert seconds < 20.0


def test_clipping_and_fp16_change_the_predicted_cpu_adam_overlap(tmp_path):
    """--clip (DeepSpeed's default 1.0) and --dtype fp16 need every gradient before an update:
    the plan then speculates where host memory allows, and what it cannot hide is exposed;
    --clip 0 overlaps exactly."""
    def plan(*extra):
        path = tmp_path / f"p{len(list(tmp_path.iterdir()))}.json"
        r, _ = protrain("plan", "--model", "llama2-13b", "--micro-batch", "4", "--seq", "2048",
                        "--save", str(path), *extra)
        assert r.returncode == 0, r.stderr
        return Plan.load(path), r.stdout
    clipped, table = plan()
    exact, exact_table = plan("--clip", "0")
    roomy, roomy_table = plan("--host-memory", "256GiB")
    fp16, _ = plan("--clip", "0", "--dtype", "fp16", "--host-memory", "256GiB")
    assert exact.n_speculate == 0 and "n_speculate" not in exact_table
    assert clipped.prediction.cpu_optim_exposed > exact.prediction.cpu_optim_exposed
    # backups only where host memory is left for them: more of it, more chunks speculate
    for p in (clipped, roomy):
        assert p.prediction.host_bytes <= p.host_memory
    assert roomy.n_speculate > clipped.n_speculate and "n_speculate" in roomy_table
    assert fp16.n_speculate > 0
    # the plan prints what a clipped step costs under the runtime's rule
    assert "if the step does not clip" in roomy_table
    p = roomy.prediction
    assert p.iter_time <= p.iter_time_unspeculated <= p.iter_time_rolled_back


def test_model_too_large_for_host_memory_fails_with_what_is_needed():
    r, _ = protrain("plan", "--model", "llama2-70b", "--host-memory", "128GiB")
    assert r.returncode == 3
    assert "host memory too small" in r.stderr and "need at least" in r.stderr
    assert "--host-memory" in r.stderr


def test_save_explain_and_json(tmp_path):
    path = tmp_path / "plan.json"
    r, _ = protrain("plan", "--model", "gpt2-1.5b", "--micro-batch", "4", "--save", str(path),
                    "--pin", "n_checkpoint=6", "--pin", "chunk_size=256MiB")
    assert r.returncode == 0, r.stderr
    plan = Plan.load(path)
    assert plan.knobs.n_checkpoint == 6 and plan.knobs.chunk_size == 256 * 2**20
    assert "(pinned)" in r.stdout
    r2, _ = protrain("explain", str(path))
    assert r2.returncode == 0 and r2.stdout.strip() == plan.explain()
    r3, _ = protrain("plan", "--model", "gpt2-1.5b", "--micro-batch", "4", "--json")
    assert Plan.from_dict(json.loads(r3.stdout)).knobs.chunk_size > 0


def test_shape_flags_and_hf_config(tmp_path):
    r, _ = protrain("plan", "--family", "llama", "--layers", "16", "--hidden", "2048", "--heads", "16",
                    "--vocab", "32000", "--micro-batch", "2", "--gpu", "a100-40gb")
    assert r.returncode == 0, r.stderr
    cfg = tmp_path / "tiny" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps({"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
                               "n_positions": 1024}))
    r, _ = protrain("plan", "--hf-config", str(cfg), "--gpu", "rtx3090")
    assert r.returncode == 0, r.stderr
    assert "tiny" in r.stdout


@pytest.mark.parametrize("args, words", [
    (["plan", "--model", "gpt5"], ["unknown --model 'gpt5'", "llama2-7b"]),
    (["plan"], ["say which model"]),
    (["plan", "--model", "gpt2-1.5b", "--pin", "n_persist=lots"], ["n_persist", "whole number"]),
    (["plan", "--model", "gpt2-1.5b", "--pin", "persist=3"], ["KNOB=VALUE"]),
    (["plan", "--model", "gpt2-1.5b", "--gpu", "tpu"], ["unknown machine 'tpu'"]),
    (["plan", "--model", "gpt2-1.5b", "--host-memory", "heaps"], ["cannot read 'heaps'"]),
])
def test_bad_arguments_exit_2_with_a_reason(args, words):
    r, _ = protrain(*args)
    assert r.returncode == 2
    for w in words:
        assert w in r.stderr, r.stderr


def test_console_script_is_installed():
    exe = shutil.which("protrain")
    if exe is None:
        pytest.skip("package not installed with pip (console script missing)")
    r = subprocess.run([exe, "list"], capture_output=True, text=True)
    assert r.returncode == 0 and "llama2-7b" in r.stdout and "h100-80gb" in r.stdout


def test_measure_profiles_the_built_in_gpt_on_this_machine(tmp_path):
    r, _ = protrain("plan", "--measure", "--model", "gpt-tiny", "--micro-batch", "2",
                    env={"PROTRAIN_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr + r.stdout
    assert "ProTrain plan for gpt-tiny" in r.stdout and "measured profile" in r.stdout
    assert list(tmp_path.glob("hardware-*.json"))   # the probe cached its measurement
    # clipping on by default: CPU Adam priced with the runtime's passes (cost/host_update.py)
    assert "with the runtime's passes around it" in r.stdout

"""The GPU benchmarks' harness works end to end (CPU smoke shapes), so a GPU session spends its
minutes measuring, not debugging scripts. No timing is asserted here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench"


def _run(script, *args):
    # A benchmark run stands alone: not in this process's distributed environment (an earlier
    # test may have set it, its port held by this process's store).
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    r = subprocess.run([sys.executable, str(BENCH / script), "--smoke", *args],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r.stdout


def test_ssd_compare_runs_every_configuration(tmp_path):
    ssd = tmp_path / "nvme"
    ssd.mkdir()
    out = _run("ssd_compare.py", "--ssd-path", str(ssd), "--results-dir", str(tmp_path))
    record = json.loads((tmp_path / "ssd_compare-cpu-smoke.json").read_text())
    results = {r["system"]: r for r in record["results"]}
    assert list(results) == ["keep", "ckpt", "ssd_all", "ssd_plan"], out
    assert all("error" not in r for r in results.values()), out
    assert results["keep"]["block_modes"] == "NN" and results["ckpt"]["block_modes"] == "CC"
    ssd_all = results["ssd_all"]
    assert ssd_all["block_modes"] == "DD" and ssd_all["ssd_backend"] == "posix"
    assert ssd_all["activation_stats"]["ssd_written_bytes"] > 0
    assert 0 < results["ssd_plan"]["device_memory_budget"] < results["keep"]["predicted_peak"]
    assert record["command"].startswith("python bench/ssd_compare.py --smoke")
    assert not list(ssd.iterdir())                # every run removed its NVMe directory


def test_ds_compare_reports_the_plan_and_the_speed(tmp_path):
    _run("ds_compare.py", "--systems", "protrain,zero0", "--results-dir", str(tmp_path))
    record = json.loads((tmp_path / "ds_compare-cpu-smoke.json").read_text())
    protrain, zero0 = record["results"]
    assert protrain["system"] == "protrain" and protrain["tokens_per_s"] > 0
    assert protrain["predicted_iter_time"] > 0 and len(protrain["losses"]) == 4
    assert protrain["bytes_moved"] == 0          # no memory pressure: nothing moves
    assert zero0["system"] == "zero0" and zero0["tokens_per_s"] > 0
    assert record["ratios"]["protrain/zero0"] > 0


def test_nvme_states_measures_states_on_the_drive_against_the_host(tmp_path):
    """The bench's ProTrain side (DeepSpeed's needs libaio, which CI does not install): every
    offloaded chunk's states on the drive train the same losses as in host memory, with fewer
    host state bytes, bytes in the directory and through the drive during the steps, none left
    after the process exits, and the predicted step beside the measured one."""
    drive = tmp_path / "drive"
    drive.mkdir()
    out = _run("nvme_states.py", "--dir", str(drive), "--systems", "host,nvme", "--rounds", "1",
               "--results-dir", str(tmp_path))
    record = json.loads((tmp_path / "nvme_states-cpu-smoke.json").read_text())
    host, nvme = record["results"]
    assert (host["system"], nvme["system"]) == ("host", "nvme") and "error" not in nvme, out
    assert host["n_nvme"] == 0 and nvme["n_nvme"] == nvme["n_chunks"] - 1 == host["n_chunks"] - 1
    assert nvme["losses_equal_host"] is True
    hs, ns = host["protrain_stats"], nvme["protrain_stats"]
    assert hs["nvme_state_bytes"] == 0 < ns["nvme_state_bytes"] == hs["host_state_bytes"]
    assert ns["host_state_bytes"] < hs["host_state_bytes"]
    assert host["drive_dir_peak_bytes"] == 0 < ns["nvme_state_bytes"] <= nvme["drive_dir_peak_bytes"]
    assert nvme["drive_write_bytes_per_step"] > 0 and nvme["drive_dir_after_exit_bytes"] == 0
    assert nvme["step_ratio"] > 0 and nvme["rss_peak"] >= nvme["rss_end"] > 0
    assert record["filesystem"] and record["ratios"]["nvme/host"] > 0
    assert not list(drive.iterdir())


def test_nvme_states_names_the_libaio_install_when_async_io_does_not_build(monkeypatch):
    """ZeRO-Infinity's side needs DeepSpeed's async_io op; where it cannot build (no libaio) the
    bench stops saying how to install it, not with DeepSpeed's build log."""
    import pytest
    from deepspeed.ops.op_builder import AsyncIOBuilder
    sys.path.insert(0, str(BENCH))
    try:
        import nvme_states
    finally:
        sys.path.remove(str(BENCH))
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    with pytest.raises(SystemExit, match=r"apt-get install -y libaio-dev"):
        nvme_states.require_async_io()


def test_plan_floor_divides_each_plan_by_a_floor_it_cannot_beat():
    """bench/plan_floor.py's smoke (issue 37): four cases planned as `protrain plan` plans them;
    the floor is computed apart from the cost model's scheduling, so a predicted iteration
    below it would mean the model prices some work at less than the hardware can do."""
    sys.path.insert(0, str(BENCH))
    import plan_floor
    result = plan_floor.run(plan_floor.QUICK, None)
    assert result["feasible"] == len(plan_floor.QUICK)
    for r in result["rows"]:
        assert r["ratio"] >= 1.0, r
        assert r["floor_s"] == max(r["terms_s"].values()) > 0
        assert r["binding"] in r["terms_s"]
    # each resource the grid is about shows up: compute-bound and CPU-Adam-bound cases
    assert {"device compute", "CPU Adam"} <= {r["binding"] for r in result["rows"]}
    # where the time above the floor goes: the binding lane's work beyond the floor's term and
    # its idle time add up to the gap, and the lane did at least the floor's work
    for r in result["rows"]:
        g = r["gap"]
        assert g["extra_work_s"] + sum(g["idle_s"].values()) == \
            pytest.approx(r["predicted_s"] - r["floor_s"], rel=1e-6, abs=1e-9), r
        assert g["extra_work_s"] >= -1e-9 * r["floor_s"] and g["busy_s"] <= r["predicted_s"] * (1 + 1e-9)
        assert r["binding"].split()[0] in plan_floor.explain(r)

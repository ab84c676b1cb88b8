"""Hardware probe on CPU: positive measurements, cached by hardware and software."""
from dataclasses import replace

from protrain.measure import probe
from protrain.profile.hardware import HardwareProfile
from protrain.measure.probe import cache_key, probe_hardware


def test_probe_measures_and_caches(tmp_path):
    hw = probe_hardware("cpu", cache_dir=tmp_path, size_mib=8, adam_params=2**18, progress=False)
    assert hw.source == "measured" and hw.device_type == "cpu"
    for v in (hw.h2d_bandwidth, hw.d2h_bandwidth, hw.gpu_adam_rate, hw.cpu_adam_rate,
              hw.device_memory, hw.host_memory, hw.host_pass_rate, hw.host_copy_bandwidth,
              hw.host_update_overhead):
        assert v > 0
    assert "torch" in hw.versions
    files = list(tmp_path.glob("hardware-*.json"))
    assert len(files) == 1 and cache_key(__import__("torch").device("cpu")) in files[0].name
    cached = HardwareProfile.load(files[0])
    assert cached == replace(hw, device_memory=0, host_memory=0)   # rates only, no budgets
    assert hw.copy_engines == 0                       # a CPU "device" copies synchronously
    assert hw.cpu_adam_kernel_rate == 0               # the kernel alone; the engine adds its passes
    # Cached: the second call reads the file instead of measuring.
    files[0].write_text(files[0].read_text().replace(str(hw.cpu_adam_rate), "12345.0"))
    again = probe_hardware("cpu", cache_dir=tmp_path, size_mib=8, adam_params=2**18, progress=False)
    assert again.cpu_adam_rate == 12345.0
    fresh = probe_hardware("cpu", cache_dir=tmp_path, size_mib=8, adam_params=2**18,
                           progress=False, refresh=True)
    assert fresh.cpu_adam_rate != 12345.0


def test_memory_budgets_are_measured_at_every_call_not_cached(tmp_path, monkeypatch):
    """A cached profile gives the rates; the memory available is what it is now (a budget
    cached from another moment, model or process would be wrong for good)."""
    total = 64 * 2**30
    avail = [40 * 2**30]
    monkeypatch.setattr(probe, "_host_memory", lambda: (total, avail[0]))
    first = probe_hardware("cpu", cache_dir=tmp_path, size_mib=8, adam_params=2**18, progress=False)
    measured = []
    monkeypatch.setattr(probe, "_cpu_adam_rate", lambda n: measured.append(n) or 1.0)
    avail[0] = 10 * 2**30
    second = probe_hardware("cpu", cache_dir=tmp_path, size_mib=8, adam_params=2**18, progress=False)
    assert not measured                                   # rates from the cache
    assert first.host_memory == 40 * 2**30 and second.host_memory == 10 * 2**30
    assert second.device_memory == 10 * 2**30            # the CPU "device" is host memory
    assert second.cpu_adam_rate == first.cpu_adam_rate

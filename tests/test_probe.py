"""Hardware probe on CPU: positive measurements, cached by hardware and software."""
from protrain.profile.hardware import HardwareProfile
from protrain.profile.probe import cache_key, probe_hardware


def test_probe_measures_and_caches(tmp_path):
    hw = probe_hardware("cpu", cache_dir=tmp_path, size_mib=8, adam_params=2**18, progress=False)
    assert hw.source == "measured" and hw.device_type == "cpu"
    for v in (hw.h2d_bandwidth, hw.d2h_bandwidth, hw.gpu_adam_rate, hw.cpu_adam_rate,
              hw.device_memory, hw.host_memory):
        assert v > 0
    assert "torch" in hw.versions
    files = list(tmp_path.glob("hardware-*.json"))
    assert len(files) == 1 and cache_key(__import__("torch").device("cpu")) in files[0].name
    assert HardwareProfile.load(files[0]) == hw
    # Cached: the second call reads the file instead of measuring.
    files[0].write_text(files[0].read_text().replace(str(hw.cpu_adam_rate), "12345.0"))
    again = probe_hardware("cpu", cache_dir=tmp_path, size_mib=8, adam_params=2**18, progress=False)
    assert again.cpu_adam_rate == 12345.0
    fresh = probe_hardware("cpu", cache_dir=tmp_path, size_mib=8, adam_params=2**18,
                           progress=False, refresh=True)
    assert fresh.cpu_adam_rate != 12345.0

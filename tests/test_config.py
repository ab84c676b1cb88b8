"""Strict settings: unknown keys and bad values fail with the key, the value and the fix."""
import pytest

from protrain.config import ConfigError, KnobPins, PlannerConfig
from protrain.units import GiB, MiB, fmt_bytes, parse_bytes


def test_sizes():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80 GiB") == parse_bytes("80G") == 80 * GiB
    assert parse_bytes("64MiB") == 64 * MiB and parse_bytes(1e9) == 10**9
    assert parse_bytes("1.5KiB") == 1536 and parse_bytes(2.0) == 2
    for bad in ("lots", "-1GB", True, None, "12 parsecs", 1.5, "0.5", "2.5B"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    assert fmt_bytes(80 * GiB) == "80.0 GiB" and fmt_bytes(512) == "512 B"


def test_from_dict_reads_sizes_pins_and_fractions():
    c = PlannerConfig.from_dict({"device_memory": "70GiB", "host_memory": 10**11,
                                 "n_persist": 3, "pins": {"chunk_size": "64MiB", "n_swap": "auto"},
                                 "memory_margin": 0.05, "chunk_sizes": ["32MiB", 2**27]})
    assert c.device_memory == 70 * GiB and c.host_memory == 10**11
    assert c.pins == KnobPins(chunk_size=64 * MiB, n_persist=3)
    assert c.memory_margin == 0.05 and c.chunk_sizes == (32 * MiB, 128 * MiB)


@pytest.mark.parametrize("data, words", [
    ({"device_memroy": "1GB"}, ["protrain.device_memroy", "did you mean 'device_memory'"]),
    ({"pins": {"n_persists": 1}}, ["protrain.pins.n_persists", "n_persist"]),
    ({"device_memory": "-4GB"}, ["protrain.device_memory", "negative"]),
    ({"host_memory": "much"}, ["protrain.host_memory", "64MiB"]),
    ({"n_buffer": -1}, ["protrain.n_buffer", "-1", "auto"]),
    ({"n_swap": 1.5}, ["protrain.n_swap", "1.5"]),
    ({"memory_margin": 2}, ["protrain.memory_margin", "[0, 1)"]),
    ({"chunk_sizes": []}, ["protrain.chunk_sizes"]),
    ({"n_persist": 1, "pins": {"n_persist": 2}}, ["given twice"]),
    # values that used to escape as OverflowError / ValueError without the key
    ({"device_memory": "1e400GiB"}, ["protrain.device_memory", "'1e400GiB'", "not a finite size"]),
    ({"host_memory": float("inf")}, ["protrain.host_memory", "inf", "not a finite size"]),
    ({"device_memory": float("nan")}, ["protrain.device_memory", "nan", "not a finite size"]),
    ({"host_memory": 10**400}, ["protrain.host_memory", "more than any machine"]),
    ({"chunk_size": "1e20"}, ["protrain.chunk_size", "'1e20'", "at most 1 EiB"]),
    ({"chunk_sizes": ["64MiB", "1e20"]}, ["protrain.chunk_sizes", "'1e20'", "at most 1 EiB"]),
    ({"device_memory": "1e20GiB"}, ["protrain.device_memory", "'1e20GiB'", "at most 1 EiB"]),
    ({"pins": "x"}, ["protrain.pins", "'x'", "mapping"]),
    ({"n_buffer": 10**30}, ["protrain.n_buffer", str(10**30), "2147483647"]),
    ({"n_persist": "everything"}, ["protrain.n_persist", "'everything'", '"all"']),
    ({"time_tolerance": 1.5}, ["protrain.time_tolerance", "[0, 1)"]),
])
def test_bad_settings_name_the_key(data, words):
    with pytest.raises(ConfigError) as e:
        PlannerConfig.from_dict(data)
    for w in words:
        assert w in str(e.value)


def test_n_persist_all_keeps_every_chunk_whatever_the_chunk_size():
    from protrain.profile.analytic import PRESETS, analytic_profile
    from protrain.profile.machines import machine
    from protrain.search import InfeasibleError, search
    c = PlannerConfig.from_dict({"n_persist": "all"})
    assert c.pins.n_persist == "all"
    hw = machine("h100-80gb").profile(host_memory=64 * GiB)
    prof = analytic_profile(PRESETS["gpt2-small"], hw)
    for size in ("128MiB", "256MiB"):
        plan = search(prof, hw, PlannerConfig.from_dict({"n_persist": "all", "chunk_size": size}))
        assert plan.knobs.n_persist == plan.chunks.n_chunks and plan.knobs.n_buffer == 0
        assert plan.prediction.h2d_bytes == 0
    with pytest.raises(InfeasibleError, match='exceeds the .* chunks.*"all"'):
        search(prof, hw, PlannerConfig.from_dict({"n_persist": 99, "chunk_size": "128MiB"}))

"""Long context (issue 36): `protrain plan --seq max` finds the longest sequence that plans and
prints its plan, the infeasible message names each degree's longest, and CUDA's allocator is
set to expandable segments at start-up unless the user set it."""
import math
import os
import re
import sys
import types

import pytest
import torch

from protrain import allocator
from protrain.cli import main
from protrain.search import InfeasibleError
from protrain.sp.longest import longest_sequence

# A small LLaMA held to 2 GiB of device memory: the longest sequence is some thousands of
# tokens, found in a few dozen milliseconds per length.
SMALL = ["plan", "--family", "llama", "--layers", "4", "--hidden", "512", "--heads", "8",
         "--kv-heads", "4", "--vocab", "8000", "--device-memory", "2GiB", "--host-memory", "16GiB"]


def _plan(capsys, *extra) -> tuple[int, str, str]:
    rc = main(SMALL + list(extra))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _longest(text: str) -> tuple[int, dict[int, int], int]:
    """(longest, {P: its longest} where several degrees were searched, the next length)."""
    m = re.search(r"longest sequence: (\d+) tokens", text)
    assert m, text
    per = {int(p): int(n) for p, n in re.findall(r"P=(\d+): (\d+)[,)]", text)}
    nxt = int(re.search(r"; at (\d+)", text).group(1))
    return int(m.group(1)), per, nxt


def test_seq_max_plans_the_longest_length_and_the_next_does_not(capsys):
    rc, out, err = _plan(capsys, "--seq", "max")
    assert rc == 0, err
    n, _, nxt = _longest(out)
    assert n % 128 == 0 and nxt == n + 128
    assert f"seq {n}," in out and "predicted peak device memory" in out     # the plan at n, printed
    assert "device memory binds" in out
    # The real planner agrees: n plans, n + 128 does not.
    assert _plan(capsys, "--seq", str(n))[0] == 0
    rc, _, err = _plan(capsys, "--seq", str(n + 128))
    assert rc == 3 and "device memory too small" in err


def test_seq_max_with_ranks_takes_the_longest_over_the_degrees(capsys):
    rc, out, err = _plan(capsys, "--seq", "max", "--world", "4")
    assert rc == 0, err
    n, per, nxt = _longest(out)
    assert sorted(per) == [1, 2, 4] and n == max(per.values())
    assert per[1] < per[2] < per[4]                  # each rank holds 1/P of the activations
    best = max(per, key=per.get)
    assert nxt == n + 128 * best and "sequence_parallel" in out
    for p, longest in per.items():
        assert longest % (128 * p) == 0
        assert _plan(capsys, "--world", "4", "--pin", f"sequence_parallel={p}", "--seq", str(longest))[0] == 0
        assert _plan(capsys, "--world", "4", "--pin", f"sequence_parallel={p}",
                     "--seq", str(longest + 128 * p))[0] == 3
    # the plan printed is the planner's own at that length (P chosen freely)
    assert _plan(capsys, "--world", "4", "--seq", str(n))[0] == 0


def test_infeasible_message_names_the_longest_sequence_under_every_degree(capsys):
    # 16 GiB of host memory for each of the 4 ranks on the node (--host-memory is the node's).
    # With 4 GiB each the leanest plan at 262144 tokens is another, and the linear estimate
    # for P=1 lands 3 granules short (15744 for 16128): an estimate, as the message says.
    # The MLPs untiled: the estimates are linear in the tokens, which the tiled MLPs' fixed
    # terms bend (their own test: tests/test_tiled_mlp_plans.py).
    node = ("--world", "4", "--host-memory", "64GiB", "--pin", "mlp_tile=0")
    _, out, _ = _plan(capsys, "--seq", "max", *node)
    _, per, _ = _longest(out)
    rc, _, err = _plan(capsys, *node, "--seq", "262144")
    assert rc == 3 and "no sequence-parallel degree fits" in err
    named = {int(p): int(n) for p, n in
             re.findall(r"P=(\d+) does not fit: needs [^;]*? \(sequences up to about (\d+) tokens fit\)", err)}
    assert sorted(named) == [1, 2, 4], err
    for p, n in named.items():
        assert n % (128 * p) == 0
        # an estimate scaled from the failing length, within a granule or two of the exact one
        assert abs(n - per[p]) <= 2 * 128 * p, (p, n, per[p])


@pytest.mark.parametrize("estimate", [None, 1.0, 1.1, 0.9, 0.0])
@pytest.mark.parametrize("fits_to", [0, 127, 128, 1000, 39100, 3 << 20])
def test_the_search_over_lengths_finds_the_last_multiple_that_fits(fits_to, estimate):
    """Whatever the estimate a failing length gives (none, right, 10% high or low, zero), the
    search lands on the longest multiple of the granule that fits, in logarithmically many plans."""
    def plan_at(seq):
        if seq <= fits_to:
            return f"plan at {seq}"
        raise InfeasibleError("too long", device_needed=1,
                              seq_len_fit=None if estimate is None else int(fits_to * estimate))
    found = longest_sequence(plan_at, 128, start=1024)
    want = fits_to // 128 * 128
    assert found.seq_len == want and found.plan == (f"plan at {want}" if want else None)
    assert found.next_error is not None and found.plans_searched <= 2 * math.log2(max(fits_to, 1024) / 128) + 6
    capped = longest_sequence(plan_at, 128, start=1024, limit=512)
    assert capped.seq_len == min(want, 512) and (capped.next_error is None) == (want >= 512)


def test_seq_max_stops_at_a_learned_position_table(capsys):
    assert main(["plan", "--model", "gpt2-small", "--seq", "max"]) == 0
    out = capsys.readouterr().out
    assert "longest sequence: 1024 tokens" in out and "position table" in out


def test_seq_max_when_nothing_fits_says_so(capsys):
    assert main(["plan", "--model", "llama2-70b", "--seq", "max", "--host-memory", "64GiB"]) == 3
    err = capsys.readouterr().err
    assert "at any sequence length" in err and "not even 128 tokens fit" in err and "host memory" in err


@pytest.mark.parametrize("value", ["foo", "0", "-5", "1.5k"])
def test_bad_seq_values_are_refused_naming_the_flag_and_the_fix(capsys, value):
    with pytest.raises(SystemExit) as e:
        main(SMALL + ["--seq", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--seq {value!r}" in err and "--seq max" in err and "e.g. --seq 4096" in err


def test_seq_max_with_measure_is_refused(capsys):
    assert main(["plan", "--measure", "--seq", "max"]) == 2
    err = capsys.readouterr().err
    assert "--seq max with --measure" in err and "--seq N" in err


# ---- the allocator at start-up ----------------------------------------------------------------

@pytest.fixture
def cuda(monkeypatch):
    """A CUDA machine as far as protrain.allocator can tell, with the torch call recorded and
    no allocator settings from the environment or the script."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "")
    for name in allocator.USER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return calls


def test_allocator_is_untouched_without_cuda(cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert allocator.choose_allocator() is None
    assert cuda == []


@pytest.mark.parametrize("name, value", [("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128"),
                                         ("PYTORCH_ALLOC_CONF", "expandable_segments:False"),
                                         ("PYTORCH_CUDA_ALLOC_CONF", "")])
def test_a_users_allocator_setting_is_kept_and_named(cuda, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    line = allocator.choose_allocator()
    assert cuda == [] and os.environ[name] == value
    assert f"{name}={value!r}" in line and "user's" in line


def test_a_setting_the_script_made_is_kept(cuda, monkeypatch):
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "backend:cudaMallocAsync")
    line = allocator.choose_allocator()
    assert cuda == [] and "backend:cudaMallocAsync" in line and "left as it is" in line


def test_cuda_gets_expandable_segments_and_says_so(cuda):
    line = allocator.choose_allocator()
    assert cuda == ["expandable_segments:True"]
    assert line.startswith("ProTrain: CUDA allocator set to expandable segments (expandable_segments:True)")
    assert "PYTORCH_ALLOC_CONF" in line
    assert all(name not in os.environ for name in allocator.USER_VARIABLES)   # nothing leaks to children


def test_megatron_lm_sets_the_allocator_before_building_the_model(cuda, monkeypatch, capsys):
    training = pytest.importorskip("protrain_megatron.training")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--protrain-auto-memory"])
    monkeypatch.setattr(training.MegatronOptions, "from_args", classmethod(lambda cls, a: None))
    monkeypatch.setattr(training, "take_over_flags", lambda a: [])
    monkeypatch.setattr(training, "apply_to_megatron_lm", lambda *a, **k: "applied")
    seen = []

    def original(provider, model_type=None, wrap_with_ddp=True):
        seen.append(list(cuda))
        return [provider()]
    args = types.SimpleNamespace(protrain_auto_memory=True, context_parallel_size=1)
    assert training.wrap_get_model(original, lambda: args)(lambda: "m", None) == ["m"]
    assert training.APPLIED.pop() == "applied"
    assert seen == [["expandable_segments:True"]]          # set before the parameters were
    assert "CUDA allocator set to expandable segments" in capsys.readouterr().out

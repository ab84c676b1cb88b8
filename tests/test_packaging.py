"""The package installs beside the stack users have (issue 34): frameworks as extras with the
ranges the suite ran on, each adapter naming the extra it needs, the planner without either."""
import subprocess
import sys
from importlib.metadata import requires, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).parent.parent


def _run(code: str) -> subprocess.CompletedProcess:
    import os

    from dpworker import free_port
    # A port of its own: this process's engines may still hold the one in MASTER_PORT.
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)


@pytest.mark.parametrize("adapter, blocked, extra", [
    ("protrain_ds", "deepspeed", "deepspeed"), ("protrain_megatron", "megatron", "megatron")])
def test_an_adapter_without_its_framework_names_the_extra_that_installs_it(adapter, blocked, extra):
    r = _run(f"import sys; sys.modules[{blocked!r}] = None; import {adapter}")
    assert r.returncode != 0
    assert "ModuleNotFoundError" in r.stderr and f"pip install 'protrain[{extra}]'" in r.stderr, r.stderr[-1500:]


def test_the_planner_runs_without_deepspeed_or_megatron():
    """``pip install protrain`` alone: the planner's command line plans."""
    r = _run("import sys; sys.modules.update(deepspeed=None, megatron=None)\n"
             "from protrain.cli import main\n"
             "sys.exit(main(['plan', '--model', 'gpt2-1.5b', '--micro-batch', '4', '--seq', '1024',"
             " '--gpu', 'h100-80gb', '--host-memory', '128GiB']))")
    assert r.returncode == 0, r.stderr[-1500:]
    assert "ProTrain plan for gpt2-1.5b" in r.stdout


def _pinned() -> dict[str, str]:
    lines = (ROOT / ".ci" / "pinned.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_frameworks_are_extras_whose_ranges_hold_the_pinned_and_installed_stack():
    reqs = [Requirement(r) for r in requires("protrain")]
    core = {r.name for r in reqs if r.marker is None}
    assert core == {"numpy", "torch", "tqdm"}, core
    pinned = _pinned()
    for r in reqs:
        if r.name in pinned:
            assert pinned[r.name] in r.specifier, (r, pinned[r.name])
            assert version(r.name).split("+")[0] in r.specifier, (r, version(r.name))
    extras = {str(r.marker) for r in reqs if r.marker is not None}
    assert {'extra == "deepspeed"', 'extra == "megatron"', 'extra == "test"'} <= extras, extras


def test_the_deepspeed_engine_trains_without_megatron():
    """``pip install 'protrain[deepspeed]'`` alone (the README's main job): a ProTrain engine
    plans and steps with megatron-core absent."""
    r = _run("import sys; sys.modules['megatron'] = None\n"
             "sys.path.insert(0, 'tests')\n"
             "from dstrain import base_config, train, with_protrain\n"
             "losses, _, engine = train(with_protrain(base_config()), steps=2)\n"
             "assert engine.protrain_runtime is not None and len(losses) == 2, losses\n"
             "print('trained', losses)")
    assert r.returncode == 0, r.stderr[-1500:]
    assert "trained" in r.stdout

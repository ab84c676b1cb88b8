"""Plan, profile and probe files written by several jobs at once (protrain.serde.dump_json)."""
import json
import os
import subprocess
import sys
import time

import pytest

from protrain import serde

# A writer process: ``rounds`` complete writes of one file, each with its own payload, fsync
# slowed so that writes from the two processes overlap between creating and renaming.
WRITER = r"""
import os, sys, time
from protrain import serde
path, who, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
real = os.fsync
def slow(fd):
    time.sleep(0.003)
    real(fd)
serde.os.fsync = slow
for i in range(rounds):
    serde.dump_json({"writer": who, "round": i, "payload": [who] * 2000, "end": True}, path)
"""


def test_two_processes_writing_one_file_both_succeed_and_the_last_complete_write_wins(tmp_path):
    path = tmp_path / "plan.json"
    rounds = 40
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), who, str(rounds)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for who in ("a", "b")]
    deadline = time.monotonic() + 120
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue                  # not written yet
        data = json.loads(text)       # a reader never sees half a file
        assert data["end"] and data["payload"] == [data["writer"]] * 2000
    outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err          # before: FileNotFoundError on the rename
    data = json.loads(path.read_text())
    assert data["round"] == rounds - 1 and data["payload"] == [data["writer"]] * 2000
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]     # no temporary file left behind


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "profile.json"
    serde.dump_json({"v": 1}, path)

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(serde.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        serde.dump_json({"v": 2}, path)
    assert json.loads(path.read_text()) == {"v": 1}
    assert os.listdir(tmp_path) == ["profile.json"]


def test_written_files_get_the_usual_permissions(tmp_path):
    """Not the 0600 of a mkstemp file: a profile cache or plan shared between users stays
    readable as any file the process writes."""
    old = os.umask(0o022)
    try:
        serde.dump_json({"v": 1}, tmp_path / "p.json")
    finally:
        os.umask(old)
    assert (tmp_path / "p.json").stat().st_mode & 0o777 == 0o644

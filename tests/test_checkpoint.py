"""Checkpoints: exact resume in a fresh process, any world size, atomic, verified."""
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from dpworker import launch

MODEL = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64, tie_embeddings=False)
PLAN = dict(chunk_size="230KiB", n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=1)
EXTRA = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 15}}, "gradient_clipping": 1.0}



def _spec(**kw):
    return dict(model=MODEL, global_batch=4, protrain=PLAN, extra=EXTRA, **kw)


@pytest.mark.parametrize("world", [1, 2])
def test_resume_in_a_fresh_process_continues_exactly(world, tmp_path):
    for d in ("full", "second"):
        (tmp_path / d).mkdir()
    # One uninterrupted 20-step run that saves after step 10 and goes on (saving is a sync
    # point: it must not change the run), then 10 steps from that checkpoint in new processes.
    ckpt = str(tmp_path / "ckpt")
    full = launch(world, _spec(steps=20, save=ckpt, save_at=10), str(tmp_path / "full"))
    assert open(os.path.join(ckpt, "latest")).read() == "global_step10"
    second = launch(world, _spec(steps=10, start=10, load=ckpt), str(tmp_path / "second"))
    for r in range(world):
        assert second[r]["losses"] == full[r]["losses"][10:], r     # bit for bit
        assert second[r]["global_steps"] == 20 and second[r]["lr"] == full[r]["lr"]
    w_full = torch.load(tmp_path / "full" / "weights.pt")
    w_res = torch.load(tmp_path / "second" / "weights.pt")
    for name, w in w_full.items():
        assert torch.equal(w_res[name], w), name


def test_load_into_another_world_size_and_consolidated_fp32_export(tmp_path):
    for d in ("two", "one"):
        (tmp_path / d).mkdir()
    ckpt = tmp_path / "ckpt"
    # Two ranks keep two chunks sharded over their devices, two offloaded: each saves its shard
    # of both kinds.
    launch(2, dict(_spec(steps=6, save=str(ckpt)), protrain=dict(PLAN, n_persist=3, n_shard=2)),
           str(tmp_path / "two"))
    from protrain_ds.checkpoint import consolidated_state_dict
    fp32 = consolidated_state_dict(ckpt)
    trained = torch.load(tmp_path / "two" / "weights.pt")
    assert set(fp32) == set(trained)
    for name, w in trained.items():
        assert torch.equal(fp32[name], w), name               # fp32 training: masters == weights
    # The same checkpoint goes on on one rank (re-sharded from the two ranks' pieces).
    one = launch(1, _spec(steps=4, start=6, load=str(ckpt)), str(tmp_path / "one"))
    assert one[0]["global_steps"] == 10 and all(l == l for l in one[0]["losses"])
    out = tmp_path / "weights.pt"
    r = subprocess.run([sys.executable, "-m", "protrain_ds.checkpoint", str(ckpt), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert torch.load(out).keys() == fp32.keys()


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeeds_zero_to_fp32_reads_a_checkpoint_of_a_zero_json(stage, tmp_path):
    """A JSON that says a ZeRO stage (the plan replaces it): the checkpoint also holds the
    files plain DeepSpeed writes at that stage, which its recovery tools read, and
    zero_to_fp32.py lies next to the tags (DeepSpeed's own tools could not read it: "can't find
    *_model_states.pt"); stages 1-2 also ``mp_rank_00_model_states.pt`` with the module. Two
    ranks, the embedding tied to the head (a shared parameter)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    ckpt = tmp_path / "ckpt"
    model = dict(MODEL, tie_embeddings=True)
    launch(2, dict(_spec(steps=3, save=str(ckpt)), model=model,
                   extra=dict(EXTRA, zero_optimization={"stage": stage})), str(tmp_path / "run"))
    trained = torch.load(tmp_path / "run" / "weights.pt")
    tag = ckpt / (ckpt / "latest").read_text()
    assert (tag / "mp_rank_00_model_states.pt").exists() == (stage < 3)
    if stage < 3:
        module = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        for name, w in trained.items():
            assert torch.equal(module[name], w), name
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    assert set(trained) <= set(fp32)
    for name, w in trained.items():
        assert torch.equal(fp32[name].contiguous(), w), name
    out = tmp_path / "fp32"
    # pytorch_model.bin: safetensors refuses tied weights, with DeepSpeed's own checkpoints too
    r = subprocess.run([sys.executable, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    written = torch.load(out / "pytorch_model.bin")
    for name, w in trained.items():
        assert torch.equal(written[name], w), name


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_checkpoint_holds_deepspeeds_module_file_for_scripts_and_plain_engines(bf16, tmp_path):
    """ZeRO-0 (no stage in the JSON): ``<tag>/mp_rank_00_model_states.pt`` as plain DeepSpeed
    writes it - ``module`` the model's state_dict (every key in order, the trained weights) -
    read by scripts with torch.load, and by a plain DeepSpeed engine's
    ``load_checkpoint(load_module_only=True)`` (it found no file before); with
    ``exclude_frozen_parameters`` the frozen values are left out, as in DeepSpeed. In bf16 the
    module holds the bf16 weights the model trains with."""
    import deepspeed
    from dstrain import TINY, base_config, with_protrain
    from protrain.models import GPT, synthetic_batch
    torch.manual_seed(0)
    model = GPT(TINY)
    model.transformer.wpe.weight.requires_grad_(False)
    cfg = base_config(gradient_clipping=1.0, **({"bf16": {"enabled": True}} if bf16 else {}))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=with_protrain(
        cfg, chunk_size="64KiB", n_persist=1))
    for i in range(3):
        x, y = synthetic_batch(TINY, 2, seed=i)
        engine.backward(engine(x, y))
        engine.step()
    assert engine.protrain_runtime.chunks.offloaded()
    engine.save_checkpoint(tmp_path / "all", tag="t")
    engine.save_checkpoint(tmp_path / "trainable", tag="t", exclude_frozen_parameters=True)
    weights = {n: t.clone() for n, t in model.state_dict().items()}
    engine.destroy()
    saved = torch.load(tmp_path / "all" / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    assert list(saved["module"]) == list(weights) and saved["global_steps"] == 3
    for name, w in weights.items():
        assert saved["module"][name].dtype == w.dtype and torch.equal(saved["module"][name], w), name
    assert weights["transformer.h.0.mlp.c_fc.weight"].dtype == (torch.bfloat16 if bf16 else torch.float32)
    lean = torch.load(tmp_path / "trainable" / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    assert set(saved["module"]) - set(lean["module"]) == {"transformer.wpe.weight"}
    torch.manual_seed(1)
    model = GPT(TINY)
    plain, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    plain.load_checkpoint(tmp_path / "all", tag="t", load_module_only=True)
    for name, w in weights.items():
        assert torch.equal(model.state_dict()[name], w), name
    plain.destroy()


def test_partial_corrupt_or_foreign_checkpoints_are_refused(tmp_path, monkeypatch):
    from dstrain import UNTIED, base_config, train, with_protrain
    import protrain_ds.checkpoint as ck
    _, _, engine = train(with_protrain(base_config(), **PLAN), UNTIED, 2)
    engine.save_checkpoint(tmp_path, tag="good")
    files = sorted(p.name for p in (tmp_path / "good").iterdir())
    assert files == ["manifest.json", "mp_rank_00_model_states.pt", "protrain_meta.pt",
                     "protrain_states_rank00000.pt"]

    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "good", bad)
    states = bad / "protrain_states_rank00000.pt"
    data = states.read_bytes()
    states.write_bytes(data[: len(data) // 2])
    with pytest.raises(ck.CheckpointError, match="protrain_states_rank00000.pt has .* bytes"):
        engine.load_checkpoint(tmp_path, tag="bad")
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0xFF
    states.write_bytes(bytes(flipped))
    with pytest.raises(ck.CheckpointError, match="checksum"):
        engine.load_checkpoint(tmp_path, tag="bad")
    (bad / "manifest.json").unlink()
    with pytest.raises(ck.CheckpointError, match="incomplete"):
        engine.load_checkpoint(tmp_path, tag="bad")
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        engine.load_checkpoint(tmp_path, tag="never")
    assert engine.load_checkpoint(tmp_path / "nothing-here") == (None, None)

    # The manifest must list every file of a checkpoint of its world size: an edited list does
    # not let an unchecked (here: corrupt) file in.
    edited = tmp_path / "edited"
    shutil.copytree(tmp_path / "good", edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    del manifest["files"]["protrain_states_rank00000.pt"]
    (edited / "manifest.json").write_text(json.dumps(manifest))
    (edited / "protrain_states_rank00000.pt").write_bytes(b"garbage")
    with pytest.raises(ck.CheckpointError, match=r"does not list \['protrain_states_rank00000.pt'\]"):
        engine.load_checkpoint(tmp_path, tag="edited")

    # What is not a (complete) ProTrain checkpoint is named for what it is.
    (tmp_path / "empty").mkdir()
    with pytest.raises(ck.CheckpointError, match="empty directory"):
        engine.load_checkpoint(tmp_path, tag="empty")
    (tmp_path / "latest").write_text("\n")
    with pytest.raises(ck.CheckpointError, match="latest is empty.*Give the tag"):
        engine.load_checkpoint(tmp_path)
    import deepspeed
    from protrain.models import GPT
    plain_model = GPT(UNTIED)
    plain, *_ = deepspeed.initialize(model=plain_model, model_parameters=plain_model.parameters(),
                                     config=base_config())
    plain.save_checkpoint(tmp_path / "ds")
    assert (tmp_path / "ds" / "global_step0" / "mp_rank_00_model_states.pt").exists()
    with pytest.raises(ck.CheckpointError, match="written by DeepSpeed without ProTrain.*load_state_dict"):
        engine.load_checkpoint(tmp_path / "ds")

    from protrain.models import GPTConfig
    _, _, other = train(with_protrain(base_config()), GPTConfig(n_layer=2, n_embd=64, n_head=4,
                                                                vocab_size=256, block_size=64), 1)
    with pytest.raises(ck.CheckpointError, match="another model"):
        other.load_checkpoint(tmp_path, tag="good")
    bias = engine.module.get_parameter("transformer.h.0.mlp.c_fc.bias")
    bias.requires_grad_(False)
    with pytest.raises(ck.CheckpointError, match=r"trained parameters \['transformer.h.0.mlp.c_fc.bias'\], "
                                                 r"which are frozen"):
        engine.load_checkpoint(tmp_path, tag="good")
    bias.requires_grad_(True)
    engine.destroy()
    other.destroy()


def _children_do(fn) -> int:
    """Run ``fn`` in a forked copy of this process (its engine included); the child's exit
    status (or -signal)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:  # noqa: BLE001 - report through the exit code only
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _kill_before_change(n: int) -> None:
    """SIGKILL this process just before its n-th change to the file system (a file or
    directory created by mkdir, renamed, replaced, removed, or a file flushed with fsync)."""
    count = [0]

    def wrap(fn):
        def call(*args, **kwargs):
            count[0] += 1
            if count[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return call
    for name in ("mkdir", "rename", "replace", "unlink", "remove", "rmdir", "fsync"):
        setattr(os, name, wrap(getattr(os, name)))


def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_a_kill_before_any_change_a_save_makes_leaves_a_loadable_checkpoint(tmp_path):
    """kill -9 at every point of a save (reusing the tag, and with a new tag): 'latest' always
    loads the previous or the new state exactly, never an error; the next save cleans up."""
    from dstrain import UNTIED, base_config, train, with_protrain
    from protrain.models import synthetic_batch
    import protrain_ds.checkpoint as ck
    _, _, engine = train(with_protrain(base_config(), **PLAN), UNTIED, 2)
    ckpt, pristine = tmp_path / "ckpt", tmp_path / "pristine"
    engine.save_checkpoint(ckpt, tag="last")
    a = ck.consolidated_state_dict(ckpt)
    x, y = synthetic_batch(UNTIED, 2, seed=99)
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(tmp_path / "ref", tag="b")
    b = ck.consolidated_state_dict(tmp_path / "ref")
    assert not _same(a, b)
    shutil.copytree(ckpt, pristine)
    for tag in ("last", "new"):
        seen_new, n = False, 0
        while True:
            n += 1
            shutil.rmtree(ckpt)
            shutil.copytree(pristine, ckpt)
            rc = _children_do(lambda: (_kill_before_change(n), engine.save_checkpoint(ckpt, tag=tag)))
            after = sorted(p.name for p in ckpt.iterdir())
            got = ck.consolidated_state_dict(ckpt)           # what 'latest' names
            assert _same(got, b) or (_same(got, a) and not seen_new), (tag, n, after)
            seen_new = _same(got, b)
            if rc == 0:
                break
            assert rc == -signal.SIGKILL, (tag, n, rc)
            # The next save (another tag) repairs: no leftovers, every tag loads A or B.
            engine.save_checkpoint(ckpt, tag="next")
            names = sorted(p.name for p in ckpt.iterdir())
            assert not [m for m in names if m.startswith(".")], (tag, n, after, names)
            assert (ckpt / "latest").read_text() == "next" and _same(ck.consolidated_state_dict(ckpt), b)
            assert _same(ck.consolidated_state_dict(ckpt, "last"), a) or \
                _same(ck.consolidated_state_dict(ckpt, "last"), b), (tag, n, after)
        assert seen_new and n > 6, (tag, n)     # the save was killed at every one of its changes
    # The engine itself loads the copy that was moved aside when the kill came between renames.
    shutil.rmtree(ckpt)
    shutil.copytree(pristine, ckpt)
    (ckpt / "last").rename(ckpt / ".last.old")
    path, _ = engine.load_checkpoint(ckpt)
    assert path.endswith(".last.old")
    engine.destroy()


def test_saves_reach_the_drive_before_they_are_published(tmp_path, monkeypatch):
    """Power loss: every file and the partial directory are flushed (fsync) before the rename
    that publishes them, and the save directory after each rename, before 'latest' names it."""
    from dstrain import UNTIED, base_config, train, with_protrain
    _, _, engine = train(with_protrain(base_config(), **PLAN), UNTIED, 1)
    engine.save_checkpoint(tmp_path, tag="t")
    events = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(a), str(b))), real_rename(a, b))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(a), str(b))), real_replace(a, b))[1])
    engine.save_checkpoint(tmp_path, tag="t")            # the tag again: the previous goes aside
    monkeypatch.undo()
    final, root = str(tmp_path / "t"), str(tmp_path)
    publish = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == final)
    partial = events[publish][1]
    synced = [e[1] for e in events[:publish] if e[0] == "fsync"]
    for name in os.listdir(final):
        assert os.path.join(partial, name) in synced, name        # contents on the drive ...
    last_manifest = max(i for i, e in enumerate(events[:publish])
                        if e[0] == "rename" and e[2].endswith("manifest.json") or
                        e[0] == "fsync" and e[1].endswith("manifest.json"))
    assert ("fsync", partial) in events[last_manifest:publish]    # ... and its directory entries
    aside = [i for i, e in enumerate(events[:publish]) if e[0] == "rename" and e[1] == final]
    assert aside and ("fsync", root) in events[aside[0]:publish]  # the old copy's rename first
    latest = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(tmp_path / "latest"))
    assert ("fsync", root) in events[publish:latest]              # <tag> exists before latest names it
    assert ("fsync", events[latest][1]) in events[publish:latest]  # latest's new text on the drive
    assert ("fsync", root) in events[latest:]
    engine.destroy()


def test_a_failed_save_removes_what_it_wrote_and_says_why(tmp_path, monkeypatch):
    """A write that fails (the file size limit as a kernel-level stand-in for a full disk, then a
    disk-full error): CheckpointError naming the file and the OS error, the partial directory
    removed, the previous checkpoint and 'latest' untouched, the next save fine."""
    from dstrain import UNTIED, base_config, train, with_protrain
    import protrain_ds.checkpoint as ck
    _, _, engine = train(with_protrain(base_config(), **PLAN), UNTIED, 1)
    engine.save_checkpoint(tmp_path, tag="good")
    states = (tmp_path / "good" / "protrain_states_rank00000.pt").stat().st_size
    err = tmp_path / "error.txt"

    def save_with_a_size_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # a write beyond it fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (states // 2, resource.RLIM_INFINITY))
        try:
            engine.save_checkpoint(tmp_path, tag="doomed")
        except Exception as e:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
            err.write_text(f"{type(e).__name__}: {e}")
            raise
    assert _children_do(save_with_a_size_limit) == 1
    msg = err.read_text()
    assert msg.startswith("CheckpointError: checkpoint 'doomed' was not saved"), msg
    assert "protrain_states_rank00000.pt" in msg and "File too large" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "error.txt") == ["good", "latest"]
    assert (tmp_path / "latest").read_text() == "good"

    # A full disk says so (the OSError behind torch's "unexpected pos" error).
    real_open, budget = open, [states // 3]

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            budget[0] -= len(b)
            if budget[0] < 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()
    monkeypatch.setattr(ck, "open", lambda *a, **k: FullDisk(real_open(*a, **k)), raising=False)
    with pytest.raises(ck.CheckpointError) as e:
        engine.save_checkpoint(tmp_path, tag="doomed")
    assert "protrain_states_rank00000.pt: No space left on device - the disk" in str(e.value)
    assert "full" in str(e.value) and "unexpected pos" not in str(e.value), str(e.value)
    monkeypatch.undo()
    assert not (tmp_path / ".doomed.partial").exists()
    engine.save_checkpoint(tmp_path, tag="fine")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "error.txt") == ["fine", "good", "latest"]
    engine.destroy()


def test_a_checkpoint_of_more_gpus_than_are_visible_restores_the_visible_ones(tmp_path, monkeypatch):
    """A checkpoint saved where 2 GPUs were visible, loaded where 1 is: the load restored the
    CUDA RNG with set_rng_state_all, which sets one device per saved state and failed on the
    missing device 1. The visible devices' states are restored (device 0 here). CPU only, so
    torch.cuda is faked: two states at the save, one device at the load, recording setters
    that refuse a device that is not there, as CUDA does."""
    from dstrain import UNTIED, base_config, train, with_protrain
    _, _, engine = train(with_protrain(base_config(), **PLAN), UNTIED, 1)
    states = [torch.full((16,), i, dtype=torch.uint8) for i in (7, 9)]
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "device_count", lambda: 2)
        m.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in states])
        engine.save_checkpoint(tmp_path, tag="two")
    rng = torch.load(tmp_path / "two" / "protrain_states_rank00000.pt", weights_only=False)["rng"]
    assert len(rng["cuda"]) == 2
    set_on = []

    def set_rng_state(state, device="cuda"):
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        set_on.append((index, state.clone()))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                        lambda ss: [set_rng_state(s, i) for i, s in enumerate(ss)])
    engine.load_checkpoint(tmp_path, tag="two")
    assert [i for i, _ in set_on] == [0] and torch.equal(set_on[0][1], states[0])
    # The engine's redo of a micro-batch after an out-of-memory error restores alike.
    from protrain_ds.engine import _set_rng_state
    set_on.clear()
    _set_rng_state((torch.random.get_rng_state(), states))
    assert [i for i, _ in set_on] == [0] and torch.equal(set_on[0][1], states[0])
    monkeypatch.undo()
    engine.destroy()

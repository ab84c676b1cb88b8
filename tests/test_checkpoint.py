"""Checkpoints: exact resume in a fresh process, any world size, atomic, verified."""
import json
import os
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
    for d in ("full", "first", "second"):
        (tmp_path / d).mkdir()
    full = launch(world, _spec(steps=20), str(tmp_path / "full"))
    ckpt = str(tmp_path / "ckpt")
    launch(world, _spec(steps=10, save=ckpt), str(tmp_path / "first"))
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
    launch(2, _spec(steps=6, save=str(ckpt)), str(tmp_path / "two"))
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


def test_partial_corrupt_or_foreign_checkpoints_are_refused(tmp_path, monkeypatch):
    from dstrain import UNTIED, base_config, train, with_protrain
    import protrain_ds.checkpoint as ck
    _, _, engine = train(with_protrain(base_config(), **PLAN), UNTIED, 2)
    engine.save_checkpoint(tmp_path, tag="good")
    files = sorted(p.name for p in (tmp_path / "good").iterdir())
    assert files == ["manifest.json", "protrain_meta.pt", "protrain_states_rank00000.pt"]

    # A crash in the middle of a save leaves the last good checkpoint and 'latest' alone.
    real = ck._atomic_save
    calls = []

    def dying(obj, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        real(obj, path)
    monkeypatch.setattr(ck, "_atomic_save", dying)
    with pytest.raises(OSError, match="disk full"):
        engine.save_checkpoint(tmp_path, tag="doomed")
    monkeypatch.setattr(ck, "_atomic_save", real)
    assert (tmp_path / "latest").read_text() == "good" and not (tmp_path / "doomed").exists()
    assert engine.load_checkpoint(tmp_path)[0].endswith("good")

    bad = tmp_path / "bad"
    import shutil
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

    from protrain.models import GPTConfig
    _, _, other = train(with_protrain(base_config()), GPTConfig(n_layer=2, n_embd=64, n_head=4,
                                                                vocab_size=256, block_size=64), 1)
    with pytest.raises(ck.CheckpointError, match="another model"):
        other.load_checkpoint(tmp_path, tag="good")
    engine.destroy()
    other.destroy()

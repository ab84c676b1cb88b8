"""Optimizer states on NVMe you can trust (issue 38): every read of the state file is checked
against checksums taken when it was written - by default - in every phase: a plain update, the
read after a speculative update, a master-only read, the restore after a rollback, and the
export a checkpoint or re-plan makes. A flipped bit stops training naming the file and offset."""
import os

import pytest
import torch

from protrain.runtime.nvme_states import NvmeStates, Outcome
from protrain.runtime.storage import StorageIOError
from protrain.runtime.streams import Streams

N = 1000      # elements of the chunk's shard


class _Chunk:
    """What NvmeStates reads of a chunk: its index, shard size and state tensors."""

    def __init__(self, index: int = 0):
        self.index, self.shard_size = index, N
        self.master = torch.arange(N, dtype=torch.float32)
        self.exp_avg = self.exp_avg_sq = None


def _states(tmp_path, *, master_separate: bool, verify: bool = True) -> tuple[NvmeStates, _Chunk]:
    c = _Chunk()
    nv = NvmeStates([0], tmp_path, Streams(torch.device("cpu")), torch.device("cpu"),
                    speculative=True, verify=verify)
    nv.open([c], master_separate=master_separate)
    nv.store_initial(c, c.master if master_separate else None)
    if master_separate:
        c.master = None
    return nv, c


def _update(nv: NvmeStates, c: _Chunk, outcome: Outcome, value: float) -> None:
    """One CPU Adam update of the chunk's states (fp32: the master is c.master, in host memory)."""
    u = nv.want(c)
    nv.hold(c, u)
    if outcome is Outcome.SPECULATED:
        nv.keep_master(c)
    c.exp_avg.fill_(value)
    c.exp_avg_sq.fill_(value * value)
    if c.master is not None:
        c.master.add_(value)
    nv.release(c, u, outcome)
    nv.drain()


def _flip(nv: NvmeStates, place: int, field: int, element: int = 7, chunk: int = 0) -> int:
    """Flip one bit of ``field`` of ``chunk``'s ``place`` in the file, as a failing drive would;
    returns the byte's offset."""
    p = nv._places[chunk]
    at = p.offset + (place * nv.fields + field) * nv.field_stride + 4 * element
    fd = os.open(nv.file.path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([b[0] ^ 0x10]), at)
        os.fsync(fd)
    finally:
        os.close(fd)
    return at


def _read_fails(nv: NvmeStates, c: _Chunk, **want) -> str:
    u = nv.want(c, **want)
    with pytest.raises(StorageIOError) as e:
        nv.hold(c, u)                  # gives the staging buffer back itself
    return str(e.value)


def _names(msg: str, nv: NvmeStates, field_at: int) -> None:
    assert str(nv.file.path) in msg and f"at offset {field_at}" in msg and "checksum" in msg, msg


def test_a_bit_flipped_after_a_plain_update_is_found_at_the_next_read(tmp_path):
    nv, c = _states(tmp_path, master_separate=False)
    _update(nv, c, Outcome.UPDATED, 0.5)
    place = nv._places[0].current
    _flip(nv, place, 1)
    msg = _read_fails(nv, c)
    _names(msg, nv, nv._places[0].offset + (place * nv.fields + 1) * nv.field_stride)
    nv.close()


def test_a_bit_flipped_after_a_committed_speculative_update_is_found(tmp_path):
    """The speculative write has three fields (the master before it too), the next read two:
    the read was not checked at all (the checksum covered the whole write)."""
    nv, c = _states(tmp_path, master_separate=False)
    _update(nv, c, Outcome.SPECULATED, 0.5)
    nv.commit(c)
    place = nv._places[0].current
    _flip(nv, place, 0)
    _names(_read_fails(nv, c), nv, nv._places[0].offset + place * nv.fields * nv.field_stride)
    nv.close()


def test_a_bit_flipped_in_the_master_is_found_by_a_master_only_read(tmp_path):
    nv, c = _states(tmp_path, master_separate=True)
    _update(nv, c, Outcome.UPDATED, 0.5)
    _flip(nv, nv._places[0].current, 0)
    assert "checksum" in _read_fails(nv, c, master_only=True)
    nv.close()


def test_a_bit_flipped_in_the_kept_master_is_found_by_the_restore_after_a_rollback(tmp_path):
    nv, c = _states(tmp_path, master_separate=False)
    before = c.master.clone()
    _update(nv, c, Outcome.SPECULATED, 0.5)
    pending = nv._places[0].pending
    nv.discard(c)
    at = _flip(nv, pending, nv.fields - 1)
    with pytest.raises(StorageIOError, match="checksum") as e:
        nv.restore_master(c)
    assert str(nv.file.path) in str(e.value)
    assert not torch.equal(c.master, before) or at        # never used: training stops here
    nv.close()


def test_an_export_of_damaged_states_is_refused_before_anything_certifies_them(tmp_path):
    """A checkpoint (or a re-plan) copies the states out through ``mapped``: with a flipped
    bit it computed a fresh checksum over the damaged bytes and resumed wrong; now the export
    is refused naming the file and offset. Undamaged, it reads what was written."""
    nv, c = _states(tmp_path, master_separate=False)
    _update(nv, c, Outcome.UPDATED, 0.25)
    with nv.mapped() as view:
        exp_avg, exp_avg_sq = view(c, 0, N)
        assert torch.equal(exp_avg, torch.full((N,), 0.25))
    _flip(nv, nv._places[0].current, 1, element=N - 1)
    with pytest.raises(StorageIOError, match="checksum"):
        with nv.mapped():
            pass
    nv.close()


def test_a_truncated_state_file_is_named_at_the_export(tmp_path):
    nv, c = _states(tmp_path, master_separate=False)
    _update(nv, c, Outcome.UPDATED, 0.25)
    os.truncate(nv.file.path, nv.file.capacity // 2)
    with pytest.raises(StorageIOError, match="truncated") as e:
        with nv.mapped():
            pass
    assert str(nv.file.path) in str(e.value)
    nv.close()


def test_ssd_verify_false_reads_without_checking(tmp_path):
    """The knob that turns the checks off (for those who accept the risk): the damage passes."""
    nv, c = _states(tmp_path, master_separate=False, verify=False)
    _update(nv, c, Outcome.UPDATED, 0.5)
    _flip(nv, nv._places[0].current, 1)
    u = nv.want(c)
    nv.hold(c, u)
    assert torch.equal(c.exp_avg, torch.full((N,), 0.5))
    assert not torch.equal(c.exp_avg_sq, torch.full((N,), 0.25))
    nv.release(c, u, Outcome.UNCHANGED)
    nv.close()


def test_damage_in_training_is_found_by_default_and_the_last_good_checkpoint_resumes_exactly(tmp_path):
    """The engine with the default settings (ssd_verify "auto"), fp32 under clipping (some
    updates speculative), 5 chunks' states on the drive: a bit flipped in the live state file
    was read back unchecked (rc 0, other losses). Now a checkpoint taken after the damage is
    refused (the last good one stays 'latest'), the next step stops naming the file, and the
    last good checkpoint resumes to the losses of the undamaged run."""
    import deepspeed
    from dstrain import UNTIED, base_config, with_protrain
    from protrain.models import GPT, synthetic_batch
    from test_nvme_states import N_NVME, PINS
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    cfg = with_protrain(base_config(gradient_clipping=1.0), **PINS, n_nvme=N_NVME, ssd_path=str(ssd))

    def engine_of(seed):
        torch.manual_seed(seed)
        model = GPT(UNTIED)
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

    def steps(engine, start, n):
        losses = []
        for i in range(start, start + n):
            x, y = synthetic_batch(UNTIED, 2, seed=i)
            loss = engine(x, y)
            engine.backward(loss * 0.6)
            engine.step()
            losses.append(loss.item())
        return losses

    good = engine_of(0)
    steps(good, 0, 3)
    good.save_checkpoint(str(tmp_path / "ckpt"), tag="good")
    undamaged = steps(good, 3, 3)
    good.destroy()

    damaged = engine_of(0)
    steps(damaged, 0, 3)
    damaged.protrain_runtime.optimizer.sync()
    nv = damaged.protrain_runtime.chunks.nvme
    _flip(nv, nv._places[max(nv.ids)].current, 0, chunk=max(nv.ids))
    with pytest.raises(Exception, match="checksum") as e:
        damaged.save_checkpoint(str(tmp_path / "ckpt"), tag="after")
    assert str(nv.file.path) in str(e.value)
    assert (tmp_path / "ckpt" / "latest").read_text() == "good"
    with pytest.raises(Exception, match="checksum") as e:
        steps(damaged, 3, 2)
    assert str(nv.file.path) in str(e.value)

    resumed = engine_of(1)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert steps(resumed, 3, 3) == undamaged
    resumed.destroy()


def test_sync_waits_for_the_write_backs_of_the_states_on_the_drive(tmp_path, monkeypatch):
    """``optimizer.sync()`` (``engine.protrain_sync()``, before anyone reads the state file) used
    to return once CPU Adam's tasks had queued their chunks' write-backs: on a slow drive (CI's)
    a write landed after it, over what a reader - the damage test above - had put there. With
    every write held back 0.2 s, no write-back is in flight after sync."""
    import time

    import deepspeed
    from dstrain import UNTIED, base_config, with_protrain
    from protrain.models import GPT, synthetic_batch
    from protrain.runtime.storage import PosixStore
    from test_nvme_states import N_NVME, PINS
    slow = PosixStore._write

    def _write(self, *a, **k):
        time.sleep(0.2)
        return slow(self, *a, **k)

    monkeypatch.setattr(PosixStore, "_write", _write)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    cfg = with_protrain(base_config(), **PINS, n_nvme=N_NVME, ssd_path=str(ssd))
    torch.manual_seed(0)
    model = GPT(UNTIED)
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    x, y = synthetic_batch(UNTIED, 2, seed=0)
    engine.backward(engine(x, y))
    engine.step()
    engine.protrain_sync()
    nv = engine.protrain_runtime.chunks.nvme
    in_flight = [i for i, p in nv._places.items() for w in p.written if w is not None and not w.done()]
    assert in_flight == [], f"chunks {in_flight}: write-backs still running after sync"
    engine.destroy()

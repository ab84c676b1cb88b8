"""Optimizer states on NVMe (issue 27, ``n_nvme``): the states of the last offloaded chunks live
in a file under ssd_path and stream through CPU Adam; training stays DeepSpeed's bit for bit
(clipping and speculation included), checkpoints move them in and out of the drive, and the
drive's files are scratch."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from deferred_streams import deferred_streams
from dpworker import free_port, launch, launch_runs
from dstrain import UNTIED, base_config, train, with_protrain
from test_ds_engine import deepspeed_run

from protrain.state_tier import STAGING_SLOTS

# Every chunk but one offloaded (110 KiB chunks of the untied tiny GPT: 14 chunks), the last
# N_NVME of them with their states on the drive; all offloaded chunks speculate under clipping.
N_NVME = 5
PINS = dict(chunk_size="110KiB", n_persist=1, n_buffer=4, n_swap=0, n_checkpoint=0,
            speculate_chunks=99)
CLIP = '{"gradient_clipping": 1.0}'
FACTOR = 0.6          # gradient norms wander around 1.0: some steps clip, some speculations roll back


def _runs_under(root) -> list[str]:
    return sorted(p for p in os.listdir(root) if not p.startswith("."))


def test_states_on_nvme_train_exactly_like_deepspeed_under_clipping(tmp_path, monkeypatch):
    """fp32, clipping at 1.0, 13 of 14 chunks offloaded, 5 with their states on the drive: every
    loss and weight equals plain DeepSpeed ZeRO-0's, through steps that clip (speculative
    updates of chunks on NVMe undone by reading back the place they did not write). Host
    memory holds no states of those chunks, only the staging ring; the file holds them; the
    directory is empty after the engine is destroyed."""
    ref_losses, ref_weights = deepspeed_run(UNTIED, CLIP, 20, loss_factor=FACTOR)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    with deferred_streams(monkeypatch):
        losses, weights, engine = train(
            with_protrain(base_config(**json.loads(CLIP)), **PINS, n_nvme=N_NVME, ssd_path=str(ssd)),
            UNTIED, 20, loss_factor=FACTOR)
    rt = engine.protrain_runtime
    stats = engine.protrain_stats()
    nvme = rt.chunks.nvme
    offloaded = rt.chunks.offloaded()
    on_drive = [c for c in offloaded if rt.chunks.on_nvme(c)]
    assert [c.index for c in on_drive] == list(range(14 - N_NVME, 14)) and len(offloaded) == 13
    assert losses == ref_losses
    assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())
    assert stats["cpu_adam_rollbacks"] > 0 and stats["cpu_adam_overlapped_chunks"] > 0
    # No state tensor of a chunk on NVMe in host memory between uses, and no speculation backup.
    rt.optimizer.sync()
    assert all(c.exp_avg is None and c.exp_avg_sq is None for c in on_drive)
    assert all(c.index not in rt.optimizer._backup for c in on_drive)
    # fp32: exp_avg and exp_avg_sq (8 bytes per element) of each chunk, on the drive.
    assert stats["nvme_state_bytes"] == sum(8 * c.shard_size for c in on_drive)
    files = list((ssd / _runs_under(ssd)[0]).glob("*.opt"))
    assert stats["nvme_file_bytes"] == sum(f.stat().st_size for f in files) >= 2 * stats["nvme_state_bytes"]
    # In host memory: the other chunks' states and speculation backups (8 + 12 bytes per
    # element), and the staging ring: STAGING_SLOTS buffers of the largest chunk's states and,
    # fp32 under clipping, its master from before a speculative update (3 fields, 4 KiB-aligned)
    # - less than if every chunk's were there.
    in_host = [c for c in offloaded if not rt.chunks.on_nvme(c)]
    ring = STAGING_SLOTS * (3 * -(-4 * max(c.shard_size for c in on_drive) // 4096) * 4096 + 4096)
    assert stats["host_state_bytes"] == sum(20 * c.shard_size for c in in_host) + ring
    assert stats["host_state_bytes"] < sum(20 * c.shard_size for c in offloaded)
    assert nvme.read_bytes > 0 and nvme.written_bytes > 0
    engine.destroy()
    assert os.listdir(ssd) == []


class _CuFileLikeStore:
    """What ``choose_store`` gives where kvikio does GPUDirect Storage: a store whose I/O takes
    device memory; kvikio's ``CuFile`` refuses a CPU ``torch.Tensor`` (it takes CUDA arrays or
    the buffer protocol)."""
    name = "kvikio"

    def _refuse(self, *args, **kwargs):
        raise TypeError("CuFile.pwrite: a CPU torch.Tensor is neither a CUDA array nor a buffer")
    write = read = _refuse

    def close(self):
        pass


def test_states_on_nvme_use_the_host_store_where_kvikio_does_gpudirect_storage(tmp_path, monkeypatch):
    """Issue 35, item 1: where GDS is active the activation tier's store is kvikio's; the states
    on NVMe are host memory (the staging ring, a chunk's master) and must not go through it.
    They train as without it, through the POSIX store, and the start-up report says why."""
    from protrain.runtime import nvme_states
    # The state tier's own name for the activation tier's choice (the bandwidth probe, which
    # measures the activation tier's store, keeps the real one).
    monkeypatch.setattr(nvme_states, "choose_store", lambda *a, **k: _CuFileLikeStore(), raising=False)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    cfg = with_protrain(base_config(), **PINS, n_nvme=2, ssd_path=str(ssd))
    losses, _, engine = train(cfg, UNTIED, 3)
    nvme = engine.protrain_runtime.chunks.nvme
    assert nvme.store.name == "posix" and "host" in nvme.backend
    assert nvme.written_bytes > 0 and all(x == x for x in losses)
    engine.destroy()


def test_the_planner_puts_states_on_the_drive_when_the_host_budget_is_short(tmp_path, monkeypatch):
    """An unchanged script, n_nvme left to the planner, a host budget below what every
    offloaded chunk's states (and their speculation backups) need in host memory: the plan
    puts the last chunks' states on the drive, the fewest that fit, the host state bytes stay
    within the budget, and the losses equal plain DeepSpeed ZeRO-0's through clipped steps."""
    ref_losses, _ = deepspeed_run(UNTIED, CLIP, 8, loss_factor=FACTOR)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    # Speculation left to the planner too: it counts the backups within the host budget.
    pins = {k: v for k, v in PINS.items() if k != "speculate_chunks"}
    cfg = with_protrain(base_config(**json.loads(CLIP)), **pins, ssd_path=str(ssd))
    with deferred_streams(monkeypatch):
        _, _, host = train(cfg, UNTIED, 1, loss_factor=FACTOR)        # everything in host memory
    need = host.protrain_plan.prediction.host_bytes
    host.destroy()
    budget = int(need * 0.85)
    cfg["protrain"]["host_memory"] = budget
    with deferred_streams(monkeypatch):
        losses, _, engine = train(cfg, UNTIED, 8, loss_factor=FACTOR)
    plan, stats = engine.protrain_plan, engine.protrain_stats()
    assert "n_nvme" not in plan.pinned and 0 < plan.knobs.n_nvme < 13
    assert plan.prediction.host_bytes <= budget and stats["host_state_bytes"] <= budget
    assert losses == ref_losses
    engine.destroy()
    assert os.listdir(ssd) == []


def test_bf16_with_the_master_on_nvme_matches_the_host_resident_run(tmp_path, monkeypatch):
    """16-bit training: the fp32 master goes to the drive too (12 bytes per element). Clipping
    with speculation: a committed speculation refreshes the upload copy from the master on
    the drive. Losses and weights equal the run with every state in host memory."""
    # Gradient norms 1.01, 0.79, 0.73, 0.78, 0.62, ... at this loss factor: clipping at 0.75
    # rolls back the speculation of step 3, and the later ones stand.
    cfg = base_config(bf16={"enabled": True}, gradient_clipping=0.75)
    pins = dict(PINS, chunk_size="55KiB")          # bf16: the same 14 chunks
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    with deferred_streams(monkeypatch):
        host_losses, host_weights, engine = train(with_protrain(cfg, **pins), UNTIED, 8, loss_factor=0.25)
        host_rollbacks = engine.protrain_stats()["cpu_adam_rollbacks"]
        engine.destroy()
        losses, weights, engine = train(with_protrain(cfg, **pins, n_nvme=N_NVME, ssd_path=str(ssd)),
                                        UNTIED, 8, loss_factor=0.25)
    stats = engine.protrain_stats()
    on_drive = [c for c in engine.protrain_runtime.chunks.offloaded()
                if engine.protrain_runtime.chunks.on_nvme(c)]
    assert stats["nvme_state_bytes"] == sum(12 * c.shard_size for c in on_drive) > 0
    assert stats["cpu_adam_rollbacks"] == host_rollbacks > 0
    assert stats["cpu_adam_overlapped_chunks"] > 0
    engine.destroy()
    assert losses == host_losses
    assert all(torch.equal(weights[n], w) for n, w in host_weights.items())
    assert os.listdir(ssd) == []


_KILLED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from dstrain import UNTIED, base_config, with_protrain
    import deepspeed, torch
    from protrain.models import GPT, synthetic_batch
    torch.manual_seed(0)
    model = GPT(UNTIED)
    cfg = with_protrain(base_config(), **{pins!r}, n_nvme={n}, ssd_path={ssd!r})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for i in range(10**6):
        x, y = synthetic_batch(UNTIED, 2, seed=i)
        engine.backward(engine(x, y))
        engine.step()
        print("stepped", flush=True)
""")


_ENDS_AFTER_STEP = textwrap.dedent("""
    import atexit, sys, time
    sys.path.insert(0, {tests!r})
    from dstrain import UNTIED, base_config, with_protrain
    import deepspeed, torch
    from protrain.models import GPT, synthetic_batch
    from protrain.runtime.optimizer import ChunkOptimizer
    torch.manual_seed(0)
    model = GPT(UNTIED)
    cfg = with_protrain(base_config(), **{pins!r}, n_nvme={n}, ssd_path={ssd!r}, host_thread=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def verdict():      # atexit: after the threading exit hooks, the runtime's included
        opt = engine.protrain_runtime.optimizer
        print("worker failed" if opt.worker.failed else "worker ok",
              "nvme error" if opt.nvme._error is not None else "nvme ok",
              "left", len(opt.nvme._active) + len(opt.nvme._waiting), flush=True)
    atexit.register(verdict)
    for i in range(3):
        if i == 2:      # the last step's updates still queued when the script ends
            real = ChunkOptimizer._update
            ChunkOptimizer._update = lambda self, *a, **k: (time.sleep(0.2), real(self, *a, **k))[1]
        x, y = synthetic_batch(UNTIED, 2, seed=i)
        engine.backward(engine(x, y))
        engine.step()
""")


def test_a_script_ending_right_after_a_step_finishes_the_updates_on_the_drive(tmp_path):
    """The last step's CPU Adam work on the host worker, with states on NVMe, still queued
    when the script ends: the runtime's exit hook finishes it before the stores' thread pools
    shut down (concurrent.futures stops them before any atexit function: the write-backs then
    failed and every update after them was skipped, silently)."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    code = _ENDS_AFTER_STEP.format(tests=os.path.dirname(__file__), pins=PINS, n=N_NVME, ssd=str(ssd))
    env = dict(os.environ, MASTER_PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "worker ok nvme ok left 0" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert _runs_under(ssd) == []


def _kill_mid_training(ssd) -> str:
    """Train with states on NVMe in a subprocess and kill -9 it after two steps; the run
    directory it leaves behind."""
    code = _KILLED.format(tests=os.path.dirname(__file__), pins=PINS, n=N_NVME, ssd=str(ssd))
    # Its own rendezvous port: this process's may be held by an engine of an earlier test.
    env = dict(os.environ, MASTER_PORT=str(free_port()))
    log = open(ssd.parent / "killed.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log,
                            text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        steps = 0
        while steps < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            steps += line.strip() == "stepped"
        assert steps == 2, open(log.name).read()[-3000:]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
        log.close()
    left = _runs_under(ssd)
    assert len(left) == 1 and list((ssd / left[0]).glob("*.opt")), left   # kill -9 skips cleanup
    return left[0]


def test_checkpoints_move_states_off_and_onto_the_drive_and_a_killed_run_is_reaped(tmp_path):
    """A run with states on NVMe saves at step 6 and goes on to 12. In a fresh process, from
    that checkpoint: states on NVMe again (steps 6-12), then every state in host memory
    (n_nvme 0, steps 6-9, saving at 9), then from that one on NVMe again (steps 9-12). Each
    continues the first run bit for bit. Before them a training process killed with -9 left
    its directory: the next run reaps it, and nothing is left after the runs."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    stale = _kill_mid_training(ssd)
    base = dict(model=dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64,
                           tie_embeddings=False),
                global_batch=2, extra=json.loads(CLIP), loss_factor=FACTOR, deferred_streams=True)
    nvme = dict(PINS, n_nvme=N_NVME, ssd_path=str(ssd))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    (tmp_path / "full").mkdir()
    full = launch(1, dict(base, protrain=nvme, steps=12, save=a, save_at=6), str(tmp_path / "full"))[0]
    assert stale not in _runs_under(ssd)
    assert full["rollbacks"] > 0
    (tmp_path / "resumed").mkdir()
    runs = launch_runs(1, {
        "nvme": dict(base, protrain=nvme, steps=6, start=6, load=a),
        "host": dict(base, protrain=dict(PINS, n_nvme=0), steps=3, start=6, load=a, save=b),
        "back": dict(base, protrain=nvme, steps=3, start=9, load=b),
    }, str(tmp_path / "resumed"))
    assert full["n_nvme"] == runs["nvme"][0]["n_nvme"] == runs["back"][0]["n_nvme"] == N_NVME
    assert runs["host"][0]["n_nvme"] == 0
    assert runs["nvme"][0]["losses"] == full["losses"][6:]
    assert runs["host"][0]["losses"] == full["losses"][6:9]
    assert runs["back"][0]["losses"] == full["losses"][9:]
    w_full = torch.load(tmp_path / "full" / "weights.pt")
    for run in ("nvme", "back"):
        got = torch.load(tmp_path / "resumed" / run / "weights.pt")
        assert all(torch.equal(got[n], w) for n, w in w_full.items()), run
    assert _runs_under(ssd) == []


class _AnonPeak:
    """The largest RssAnon (host memory nothing but swap can reclaim: tensors, not the page
    cache a file mapping shows in VmRSS) seen while the body runs, sampled every millisecond."""

    def __enter__(self):
        import threading
        self.peak = self.base = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.now())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("RssAnon:"))
        return int(line.split()[1]) * 1024

    @property
    def grown(self) -> int:
        return self.peak - self.base


def test_a_checkpoint_streams_the_states_on_the_drive_through_host_memory(tmp_path, monkeypatch):
    """fp32, about 75 MB of optimizer states on the drive (every chunk's): saving a checkpoint maps them from
    the state file instead of copying them into host tensors (host memory that cannot be
    reclaimed grows by far less than they take), and loading it back writes them to the drive
    chunk by chunk; the loaded run goes on exactly like the saving one."""
    from protrain.models import GPTConfig, synthetic_batch
    big = GPTConfig(n_layer=3, n_embd=512, n_head=8, vocab_size=256, block_size=64,
                    tie_embeddings=False)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    pins = dict(chunk_size="8MiB", n_persist=0, n_buffer=4, n_swap=0, n_checkpoint=0)
    cfg = with_protrain(base_config(), **pins, n_nvme=7, ssd_path=str(ssd), device_memory="4GiB")
    with deferred_streams(monkeypatch):
        _, _, engine = train(cfg, big, 1)
        states = engine.protrain_stats()["nvme_state_bytes"]
        assert states > 64 * 2**20
        with _AnonPeak() as saving:
            engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
        x, y = synthetic_batch(big, 2, seed=7)
        engine.backward(engine(x, y))
        engine.step()
        after = engine(x, y).item()
        with _AnonPeak() as loading:
            engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
        engine.backward(engine(x, y))
        engine.step()
        again = engine(x, y).item()
        engine.destroy()
    # Copied into host tensors, as before, the save grew by the states and the fp32 master
    # (143 MB for 103 MB of states at 4 layers); mapped, by 0.4 MB. The load holds one
    # parameter's pieces at a time (4 fields of the largest: 16 MB) and one staging buffer.
    assert saving.grown < states / 16, (saving.grown, states)
    assert loading.grown < states / 4, (loading.grown, states)
    assert again == after


def test_a_checkpoint_of_host_resident_states_copies_none_of_them(tmp_path, monkeypatch):
    """Issue 35, item 6: saving a checkpoint (or re-planning) used to copy every host-resident
    optimizer state into pageable memory (``.cpu().clone()``: 12 bytes per parameter outside
    the host budget, an OOM kill at 70B). The states of offloaded chunks in host memory are
    written from where they are; the loaded run goes on exactly like the saving one."""
    from protrain.models import GPTConfig, synthetic_batch
    big = GPTConfig(n_layer=3, n_embd=512, n_head=8, vocab_size=256, block_size=64,
                    tie_embeddings=False)
    pins = dict(chunk_size="8MiB", n_persist=0, n_buffer=4, n_swap=0, n_checkpoint=0)
    cfg = with_protrain(base_config(), **pins, device_memory="4GiB")
    with deferred_streams(monkeypatch):
        _, _, engine = train(cfg, big, 1)
        states = engine.protrain_stats()["host_state_bytes"]
        assert states > 64 * 2**20
        with _AnonPeak() as saving:
            engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
        x, y = synthetic_batch(big, 2, seed=7)
        engine.backward(engine(x, y))
        engine.step()
        after = engine(x, y).item()
        engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
        engine.backward(engine(x, y))
        engine.step()
        again = engine(x, y).item()
        engine.destroy()
    # Copied, the save grew by the three fp32 states (about 103 MB here).
    assert saving.grown < states / 16, (saving.grown, states)
    assert again == after


# (micro-batch, tokens) of each rank's batch per step: rank 1's 40 tokens at step 2 re-plan
# both ranks for longer batches, moving every state into the new runtime's chunks and file.
_SHAPES = [[[2, 16], [2, 16]], [[2, 16], [2, 16]], [[2, 16], [2, 40]], [[2, 40], [2, 24]],
           [[2, 24], [2, 32]], [[1, 12], [1, 8]]]


def test_two_ranks_with_states_on_nvme_equal_deepspeed_zero0_across_a_longer_batch_replan(tmp_path):
    """Two gloo ranks, each with its shard of the last N_NVME chunks' states in its own file
    under one ssd_path, clipping at 1.0 with speculation (some steps clip): losses and weights
    are DeepSpeed ZeRO-0's on two ranks bit for bit. Then batches that grow: the re-plan for
    the longer one exports the states from the old runtime's files (mapped views) and
    exchanges them between the ranks into the new runtime's: still DeepSpeed's bit for bit.
    Nothing is left under ssd_path."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    model = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64, tie_embeddings=False)
    clip = dict(model=model, global_batch=4, steps=12, loss_factor=0.7, extra=json.loads(CLIP))
    shapes = dict(model=model, global_batch=4, steps=len(_SHAPES), batches=_SHAPES)
    nvme = dict(PINS, n_nvme=N_NVME, ssd_path=str(ssd))
    runs = launch_runs(2, {
        "deepspeed": dict(clip, protrain=None),
        "nvme": dict(clip, deferred_streams=True, protrain=nvme),
        "deepspeed shapes": dict(shapes, protrain=None),
        "nvme shapes": dict(shapes, deferred_streams=True, protrain=dict(nvme, sequence_parallel=1)),
    }, str(tmp_path))
    for ref, got in (("deepspeed", "nvme"), ("deepspeed shapes", "nvme shapes")):
        assert [r["losses"] for r in runs[ref]] == [r["losses"] for r in runs[got]], got
        w1 = torch.load(tmp_path / ref / "weights.pt")
        w2 = torch.load(tmp_path / got / "weights.pt")
        assert all(torch.equal(w2[n], w) for n, w in w1.items()), got
        assert all(r["n_nvme"] == N_NVME and r["races"] == 0 for r in runs[got]), got
    assert all(r["rollbacks"] > 0 and r["overlapped_chunks"] > 0 for r in runs["nvme"])
    plans = runs["nvme shapes"][0]["plans"]
    assert [p[0] for p in plans] == [16, 16, 64, 64, 64, 64]     # re-planned at step 2
    assert _runs_under(ssd) == []


def test_an_out_of_memory_replan_with_states_on_nvme_keeps_training_exactly(tmp_path):
    """fp32, clipping, two micro-batches per step: an out-of-memory error in the second
    micro-batch of step 2 re-plans, moving the states on the drive (mapped from the old file)
    and the gradients accumulated so far into the new runtime, which keeps its states on the
    drive again: losses equal the run with every state in host memory and no error."""
    from test_oom import PLAN, run
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    cfg = base_config(gradient_accumulation_steps=2, **json.loads(CLIP))
    ref, ref_engine, _ = run(cfg, 5)
    ref_engine.destroy()
    losses, engine, injector = run(cfg, 5, inject=("forward", {4}),
                                   pins=dict(PLAN, n_ssd=0, n_nvme=N_NVME, ssd_path=str(ssd)))
    assert injector.fired == [4] and losses == ref
    assert engine.protrain_plan.knobs.n_nvme == N_NVME and engine.protrain_plan.memory_margin > 0.1
    assert engine.protrain_stats()["nvme_state_bytes"] > 0 and len(_runs_under(ssd)) == 1
    engine.destroy()
    assert _runs_under(ssd) == []


def test_an_fp16_overflow_with_chunks_on_nvme_speculating_is_skipped_exactly(tmp_path, monkeypatch):
    """fp16 (dynamic loss scale, clipping 1.0), the master and moments of the last N_NVME
    chunks on the drive: those chunks update speculatively during backward, then a gradient
    of block 0 (reached last) is made inf on step 3. The step is skipped - the speculative
    places discarded, the master as before - weights as after step 2, the scale halved, and
    the run equals the host-resident one that never speculates, bit for bit."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from protrain.models import GPT, synthetic_batch
    from test_ds_engine import SHAPES
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)
    model_cfg, pins = SHAPES["a mix"]
    pins = dict(pins, chunk_size="55KiB")
    cfg = base_config(fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1}, gradient_clipping=1.0)
    ssd = tmp_path / "ssd"
    ssd.mkdir()

    def run(**section):
        torch.manual_seed(0)
        model = GPT(model_cfg)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=with_protrain(cfg, **pins, **section))
        poison = {"on": False}
        model.transformer.h[0].mlp.c_fc.weight.register_hook(
            lambda g: torch.full_like(g, float("inf")) if poison["on"] else g)
        trace, snapshots = [], []
        for i in range(6):
            x, y = synthetic_batch(model_cfg, 2, seed=i)
            poison["on"] = i == 3
            loss = engine(x, y)
            engine.backward(loss * 0.25)
            engine.step()
            trace.append((loss.item(), engine.optimizer.overflow, engine.optimizer.cur_scale))
            if i in (2, 3):
                snapshots.append({n: t.clone() for n, t in model.state_dict().items()})
        stats = engine.protrain_stats()
        state = model.state_dict()        # a sync point: the last step's host updates done
        weights = {n: state[n].clone() for n, _ in model.named_parameters()}
        engine.destroy()
        return trace, snapshots, stats, weights

    plain = run(speculate_chunks=0)
    with deferred_streams(monkeypatch):
        trace, (before, after), stats, weights = run(speculate_chunks=99, n_nvme=N_NVME, ssd_path=str(ssd))
    assert [t[1] for t in trace] == [False, False, False, True, False, False]
    assert trace[3][2] == trace[2][2] / 2
    assert all(torch.equal(after[n], t) for n, t in before.items())        # step 3 changed nothing
    assert stats["cpu_adam_rollbacks"] > 0 and stats["cpu_adam_overlapped_chunks"] > 0
    assert stats["nvme_state_bytes"] > 0
    assert trace == plain[0]
    assert all(torch.equal(weights[n], w) for n, w in plain[3].items())
    assert _runs_under(ssd) == []

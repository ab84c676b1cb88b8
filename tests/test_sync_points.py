"""Sync points of the updates ``step()`` leaves running (protrain/runtime/optimizer.py's module
docstring): whatever reads host states after step() returns must see the finished updates.

Every test holds each offloaded chunk's CPU Adam update on the worker thread (a real thread
under tests/deferred_streams.py) until something waits for it (``HeldUpdates``): as late as
the runtime allows, so a sync point that does not wait reads the states from before the
update, a wrong value, every time (no timing involved). Each test checks that the updates
were indeed still held when its sync point came, and compares what it reads bit for bit
with plain DeepSpeed ZeRO-0 (same model, batches and clipping).
"""
import functools
import json
import os
import subprocess
import sys
import threading
import weakref
from collections import deque

import torch

from deferred_streams import deferred_streams
from dstrain import base_config, with_protrain
from test_ds_engine import SHAPES

import deepspeed
from protrain.models import GPT, synthetic_batch
from protrain.runtime.optimizer import ChunkOptimizer, HostWorker

MODEL, PINS = SHAPES["a mix"]       # offloaded chunks, swapped and checkpointed blocks
CLIP = {"gradient_clipping": 1.0}
# Clipping on and no speculation: every offloaded chunk's update is left to step(), so every
# one of them is pending when step() returns.
PROTRAIN = dict(PINS, speculate_chunks=0)
EVAL_AFTER = 2                       # the reference evaluates after this many steps


def config(**protrain) -> dict:
    """Clipping at 1.0 (DeepSpeed's default); torch's AdamW on both sides (DeepSpeed's
    "torch_adam"): DeepSpeed's CPU Adam kernel would match as well, but probing the CPU to
    load it takes seconds per engine."""
    cfg = base_config(**CLIP)
    cfg["optimizer"]["params"]["torch_adam"] = True
    return with_protrain(cfg, **protrain) if protrain else cfg


def _batch(i):
    return synthetic_batch(MODEL, 2, seed=i)


EVAL_BATCH = 1000                    # a batch no training step uses


@functools.lru_cache(maxsize=None)
def reference(steps: int = 4):
    """Plain DeepSpeed ZeRO-0: per step the loss and, after it, every parameter's weights,
    exp_avg, exp_avg_sq and Adam step count (by name); the eval loss after EVAL_AFTER steps."""
    torch.manual_seed(0)
    model = GPT(MODEL)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config())
    losses, states, eval_loss = [], [], None
    for i in range(steps):
        x, y = _batch(i)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        opt_state = engine.optimizer.state
        states.append({n: (p.detach().clone(), opt_state[p]["exp_avg"].clone(),
                           opt_state[p]["exp_avg_sq"].clone(), int(opt_state[p]["step"]))
                       for n, p in model.named_parameters()})
        if i + 1 == EVAL_AFTER:         # as the ProTrain runs do: an eval between steps
            engine.eval()
            with torch.no_grad():
                eval_loss = engine(*_batch(EVAL_BATCH)).item()
            engine.train()
    engine.destroy()
    return losses, states, eval_loss


class HeldUpdates:
    """Holds the host tasks each optimizer step submits (the rest of every offloaded chunk's
    CPU Adam update) on the worker thread until something waits for them: an upload for its
    own chunk (``wait_host_ready``) or a ``drain`` (``sync``, close, ...) for all of them. A
    worker that slow is legal, so a reader that does not wait sees the states from before
    the update, every time. Records how many offloaded chunks were still pending when each
    step() returned, and what released each update."""

    def __init__(self, monkeypatch):
        self.cond = threading.Condition()
        self.wanted: set = set()          # (optimizer, chunk index) an upload waits for
        self.draining = 0                 # drains in progress
        self.steps = 0
        self.pending_at_return: list[int] = []
        self.released: list[tuple[int, str]] = []
        """Per update: (its step, 1-based; "upload" or "drain": what released it)."""
        self.queued = weakref.WeakKeyDictionary()   # optimizer -> chunk -> steps, in order
        step, finish = ChunkOptimizer.step, ChunkOptimizer._finish_chunk
        wait, drain = ChunkOptimizer.wait_host_ready, HostWorker.drain
        held = self

        def stepping(opt):
            held.steps += 1
            per_chunk = held.queued.setdefault(opt, {})
            for c in opt.chunks.offloaded():     # step() submits one task per offloaded chunk
                per_chunk.setdefault(c.index, deque()).append(held.steps)
            step(opt)
            held.pending_at_return.append(sum(not e.is_set() for e in opt._ready.values()))

        def gated(opt, c, *a):
            n = held.queued[opt][c.index].popleft()
            with held.cond:
                held.cond.wait_for(lambda: (opt, c.index) in held.wanted or held.draining,
                                   timeout=30)
                held.released.append((n, "upload" if (opt, c.index) in held.wanted else
                                      "drain" if held.draining else "timeout"))
            finish(opt, c, *a)

        def waiting(opt, c):
            with held.cond:
                held.wanted.add((opt, c.index))
                held.cond.notify_all()
            try:
                wait(opt, c)
            finally:
                with held.cond:
                    held.wanted.discard((opt, c.index))

        def draining(worker):
            with held.cond:
                held.draining += 1
                held.cond.notify_all()
            try:
                drain(worker)
            finally:
                with held.cond:
                    held.draining -= 1
        monkeypatch.setattr(ChunkOptimizer, "step", stepping)
        monkeypatch.setattr(ChunkOptimizer, "_finish_chunk", gated)
        monkeypatch.setattr(ChunkOptimizer, "wait_host_ready", waiting)
        monkeypatch.setattr(HostWorker, "drain", draining)

    def released_by(self, step: int, what: str) -> int:
        return self.released.count((step, what))


def train(engine, steps: int, start: int = 0) -> list[float]:
    losses = []
    for i in range(start, start + steps):
        x, y = _batch(i)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def protrain_engine(seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(MODEL)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(**PROTRAIN))
    return model, engine


def weights_of(model) -> dict:
    state = model.state_dict()      # a sync point itself (tests/test_cpu_adam_overlap.py)
    return {n: state[n].detach().clone() for n, _ in model.named_parameters()}


def assert_weights(got: dict, want_state: dict) -> None:
    assert set(got) == set(want_state)
    for n, (w, *_) in want_state.items():
        assert torch.equal(got[n], w), n


def test_checkpoint_saved_or_loaded_with_updates_pending_resumes_exactly(monkeypatch, tmp_path):
    """save_checkpoint right after step(): the files hold the updated weights and Adam states
    (not those of before the last step). load_checkpoint right after step(): the states loaded
    are not overwritten by the step's updates landing later. Training resumed either way (in
    the same engine, in a fresh one) goes on exactly as uninterrupted DeepSpeed."""
    from protrain.runtime.states import assemble
    from protrain_ds.checkpoint import consolidated_state_dict, read_pieces, resolve
    ref_losses, ref_states, _ = reference()
    with deferred_streams(monkeypatch):
        held = HeldUpdates(monkeypatch)
        _, engine = protrain_engine()
        losses = train(engine, 2)
        n_off = len(engine.protrain_runtime.chunks.offloaded())
        engine.save_checkpoint(tmp_path)
        assert held.pending_at_return == [n_off] * 2 and n_off > 0
        assert held.released_by(2, "drain") == n_off          # by the save, all of them
        assert losses == ref_losses[:2]
        # What was written: the weights (the consolidated fp32 export), Adam m, v and steps.
        assert_weights(consolidated_state_dict(tmp_path), ref_states[1])
        pieces = read_pieces(resolve(tmp_path), 1)
        for name, (w, m, v, step) in ref_states[1].items():
            master, exp_avg, exp_avg_sq, saved_step, _ = assemble(pieces, name, 0, w.numel())
            assert torch.equal(master.view_as(w), w), name
            assert torch.equal(exp_avg.view_as(m), m) and torch.equal(exp_avg_sq.view_as(v), v), name
            assert saved_step == step, name
        # One step more, then back to the checkpoint with that step's updates still held.
        train(engine, 1, start=2)
        assert held.pending_at_return[-1] == n_off
        engine.load_checkpoint(tmp_path)
        assert held.released_by(3, "drain") == n_off          # by the load
        rewound = train(engine, 2, start=2)
        rewound_weights = weights_of(engine.module)
        engine.destroy()
        assert rewound == ref_losses[2:4]
        assert_weights(rewound_weights, ref_states[3])
        # Resumed in a fresh engine from other initial weights: exactly DeepSpeed's steps 3, 4.
        model, engine = protrain_engine(seed=1)
        engine.load_checkpoint(tmp_path)
        assert engine.global_steps == len(losses)
        losses = train(engine, 2, start=2)
        weights = weights_of(model)
        engine.destroy()
    assert losses == ref_losses[2:4]
    assert_weights(weights, ref_states[3])


def test_16bit_model_export_with_updates_pending_holds_them(monkeypatch, tmp_path):
    """DeepSpeed's save_16bit_model (through module_state_dict: the engine's consolidated
    export) right after step() writes the updated weights."""
    _, ref_states, _ = reference()
    with deferred_streams(monkeypatch):
        held = HeldUpdates(monkeypatch)
        _, engine = protrain_engine()
        train(engine, 2)
        assert engine.save_16bit_model(str(tmp_path), "model.bin")
        n_off = len(engine.protrain_runtime.chunks.offloaded())
        engine.destroy()
    assert held.pending_at_return == [n_off] * 2 and n_off > 0
    assert held.released_by(2, "drain") == n_off      # by the export (state_dict's sync)
    saved = torch.load(tmp_path / "model.bin")
    assert_weights({n: saved[n] for n in ref_states[1]}, ref_states[1])


def test_eval_forward_with_updates_pending_sees_them_and_training_goes_on_exactly(monkeypatch):
    """An evaluation forward right after step() (no_grad, eval mode) uploads every offloaded
    chunk after its update: DeepSpeed's eval loss; training after it is unchanged, and so are
    the weights destroy() gives back right after the last step."""
    ref_losses, ref_states, ref_eval = reference()
    with deferred_streams(monkeypatch):
        held = HeldUpdates(monkeypatch)
        model, engine = protrain_engine()
        losses = train(engine, EVAL_AFTER)
        engine.eval()
        with torch.no_grad():
            eval_loss = engine(*_batch(EVAL_BATCH)).item()
        engine.train()
        eval_waited = held.released_by(EVAL_AFTER, "upload")
        losses += train(engine, 4 - EVAL_AFTER, start=EVAL_AFTER)
        n_off = len(engine.protrain_runtime.chunks.offloaded())
        engine.destroy()            # right after step(): close, a sync point too
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert held.pending_at_return == [n_off] * 4 and n_off > 0
    assert eval_waited == n_off              # each upload of the eval waited for its update
    assert held.released_by(4, "drain") == n_off      # by destroy()
    assert eval_loss == ref_eval
    assert losses == ref_losses
    assert_weights(weights, ref_states[3])


def test_replan_with_updates_pending_carries_the_updated_states(monkeypatch, capsys):
    """An out-of-memory error in the forward right after step(), while the updates of chunks
    that forward had not reached yet are still held: the re-plan moves the updated states
    into the new plan's chunks, and training goes on exactly as DeepSpeed's."""
    from dataclasses import replace

    import protrain_ds.engine as engine_mod
    from protrain.runtime.states import export_pieces
    from test_oom import InjectOOM
    ref_losses, ref_states, _ = reference()
    carried, pending_at_replan = [], []
    move = engine_mod.ProTrainEngine._protrain_move       # the re-plan, for any reason

    def replanning(self, *args, **kwargs):
        opt = self.protrain_runtime.optimizer
        pending_at_replan.append(sum(not e.is_set() for e in opt._ready.values()))
        plans = move(self, *args, **kwargs)
        # Cloned: an offloaded chunk's pieces are its host states themselves (no copy), valid
        # until the runtime's next step changes them.
        carried.append({p.name: replace(p, master=p.master.clone(), exp_avg=p.exp_avg.clone(),
                                        exp_avg_sq=p.exp_avg_sq.clone())
                        for p in export_pieces(self.protrain_runtime.chunks)})
        return plans
    monkeypatch.setattr(engine_mod.ProTrainEngine, "_protrain_move", replanning)
    with deferred_streams(monkeypatch) as made:
        held = HeldUpdates(monkeypatch)
        torch.manual_seed(0)
        model = GPT(MODEL)
        injector = InjectOOM(model, "forward", {3})      # the forward after step 2
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config(**PROTRAIN))
        injector.engine = engine
        losses = train(engine, 2)
        n_off = len(engine.protrain_runtime.chunks.offloaded())
        losses += train(engine, 2, start=2)
        weights = weights_of(model)
        engine.destroy()
    assert injector.fired == [3] and len(made) == 2          # a second runtime
    assert "out of device memory in forward" in capsys.readouterr().out
    assert held.pending_at_return[:2] == [n_off] * 2 and n_off > 0
    # The re-plan began with the updates of chunks the failed forward had not reached held.
    assert pending_at_replan and pending_at_replan[0] == held.released_by(2, "drain") > 0
    (pieces,) = carried
    for name, (w, m, v, step) in ref_states[1].items():
        p = pieces[name]
        assert torch.equal(p.master.view_as(w), w), name
        assert torch.equal(p.exp_avg.view_as(m), m) and torch.equal(p.exp_avg_sq.view_as(v), v), name
        assert p.step == step, name
    assert losses == ref_losses
    assert_weights(weights, ref_states[3])


EXIT_SCRIPT = r"""
import atexit, json, sys, threading
import torch
import deepspeed
from dstrain import base_config, with_protrain
from protrain.models import GPT, GPTConfig, synthetic_batch

model_cfg, pins = GPTConfig(**json.loads(sys.argv[1])), json.loads(sys.argv[2])
engine = None


def last_words():
    # Registered before the engine exists: runs after the exit hook the runtime registers
    # (atexit runs the hooks last registered first), just before finalization.
    if engine is None:
        return
    opt = engine.protrain_runtime.optimizer
    print("host threads alive:", sum(t.name == "protrain-host" for t in threading.enumerate()))
    print("updates pending:", sum(not e.is_set() for e in opt._ready.values()), flush=True)
atexit.register(last_words)

gates = []
big = [torch.randn(1500, 1500)]


def holding_submit(submit, gate):
    def held(fn):
        def task():
            gate.wait()
            if len(gates) == 3 and big:
                # Stands for a large chunk's CPU Adam: a native call without the GIL, running
                # as the interpreter begins to shut down.
                big.pop() @ torch.randn(1500, 1500)
            fn()
        submit(task)
    return held


from protrain.runtime.optimizer import ChunkOptimizer
step = ChunkOptimizer.step


def stepping(self):
    gates.append(threading.Event())
    self.worker.submit = holding_submit(type(self.worker).submit.__get__(self.worker), gates[-1])
    try:
        step(self)
    finally:
        del self.worker.submit
ChunkOptimizer.step = stepping

torch.manual_seed(0)
model = GPT(model_cfg)
cfg = base_config(gradient_clipping=1.0)
cfg["optimizer"]["params"]["torch_adam"] = True     # no DeepSpeed CPU Adam build: a faster start
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config=with_protrain(cfg, **pins, speculate_chunks=0,
                                                       host_thread=True))
for i in range(3):
    x, y = synthetic_batch(model_cfg, 2, seed=i)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    if i < 2:
        gates[i].set()
print("pending at the end of the script:",
      sum(not e.is_set() for e in engine.protrain_runtime.optimizer._ready.values()), flush=True)
# Released as the interpreter shuts down: it waits for this non-daemon thread, then goes on
# to the exit hooks and finalization while the worker runs the held updates.
threading.Timer(0.3, gates[-1].set).start()
"""


def test_process_exit_with_updates_pending_finishes_them_and_exits_cleanly(tmp_path):
    """A script that ends right after step() (no destroy): the interpreter must neither crash
    (a daemon thread inside a native call without the GIL when finalization starts is killed
    on its way back to the GIL: "terminate called without an active exception", SIGABRT) nor
    hang. The runtime's exit hook lets the worker finish the pending updates and stop before
    finalization: states stay consistent for exit hooks that run later (one could save a
    checkpoint), at the cost of at most the rest of one step's CPU Adam."""
    import dataclasses
    script = tmp_path / "train_and_exit.py"
    script.write_text(EXIT_SCRIPT)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [tests] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("MASTER_PORT", None)     # this process's rendezvous port: dstrain picks another
    # A hang raises TimeoutExpired (the script takes seconds).
    r = subprocess.run([sys.executable, str(script), json.dumps(dataclasses.asdict(MODEL)),
                        json.dumps(PINS)], env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    for bad in ("Traceback", "terminate called", "Fatal Python error", "Exception ignored"):
        assert bad not in r.stderr, r.stderr[-3000:]
    assert "pending at the end of the script:" in out
    pending = int(out.split("pending at the end of the script:")[1].split()[0])
    assert pending > 0                                  # the script did end with updates held
    assert "host threads alive: 0" in out, out          # stopped before finalization
    assert "updates pending: 0" in out, out             # after finishing what was queued

"""torch.compile with the ProTrain engine: the ways a DeepSpeed script asks for it, taken over.

- ``model = torch.compile(model)`` (or ``model.compile()``) before ``deepspeed.initialize``:
  initialize takes the wrapper off (``eager_model``); the engine's module is the eager model;
- ``engine.compile(backend, compile_kwargs)``, which the Hugging Face Trainer calls (through
  accelerate) for ``TrainingArguments(torch_compile=True)``: DeepSpeed would compile the whole
  module; the engine keeps the request instead (``engine_compile``);
- ``module.compile()`` on submodules after initialize (accelerate's regional compilation):
  undone at the first forward (``before_planning``).

Then the model is profiled and planned eager, and the runtime compiles the blocks' forwards
(protrain.runtime.compile says what is compiled, what runs eager and why); the engine prints
that once.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from protrain.config import ConfigError
from protrain.runtime.compile import CompileRequest, take_compiled


def eager_model(model):
    """(the eager model, the compile request its torch.compile wrappers held, or None)."""
    if model is None:
        return None, None
    return take_compiled(model)


def before_planning(engine) -> None:
    """At the first forward: compile applied to the engine's module after initialize (in
    place, e.g. accelerate's regional compilation) is taken off and kept as the request,
    unless ``engine.compile()`` asked already."""
    _, request = take_compiled(engine.module)
    if request is not None and engine.protrain_compile is None:
        engine.protrain_compile = request     # engine.is_compiled stays DeepSpeed's: engine.compile() only


def engine_compile(engine, backend, compile_kwargs: dict, schedule,
                   compiled_autograd_enabled: bool) -> None:
    """``DeepSpeedEngine.compile`` under ProTrain: keep the request (before planning) or
    compile the running plan's blocks now (after)."""
    if schedule is not None:
        raise ConfigError("engine.compile(schedule=...) is DeepSpeed's DeepCompile schedule, which "
                          "partitions with ZeRO; ProTrain places parameters itself: call "
                          "engine.compile() without a schedule")
    if engine.is_compiled:
        return
    kwargs = {k: v for k, v in compile_kwargs.items() if k != "backend"}
    request = CompileRequest.from_options(backend, "engine.compile()", **kwargs)
    engine.protrain_compile = request
    engine._is_compiled = True
    engine._compile_mode = "model"
    engine._compile_kwargs = compile_kwargs
    if compiled_autograd_enabled and engine.global_rank == 0:
        print("ProTrain: engine.compile(compiled_autograd_enabled=True): compiled autograd is not "
              "used (backward runs the runtime's hooks between blocks: chunk uploads, gradient "
              "offloads); each compiled block's backward is compiled with its forward", flush=True)
    if engine.protrain_runtime is not None:
        engine.protrain_runtime.set_compile(request)
        engine._protrain_compile_said = False
        announce(engine)


def announce(engine) -> None:
    """Say once (rank 0) what the runtime compiled and what runs eager."""
    rt = engine.protrain_runtime
    line = rt.compiled.summary() if rt is not None else None
    if line is None or getattr(engine, "_protrain_compile_said", False):
        return
    engine._protrain_compile_said = True
    if engine.global_rank == 0:
        print(line, flush=True)


@contextmanager
def eager_profiling(request: CompileRequest | None):
    """Profiling runs the eager model; an error in it says that compile is not the cause and
    what to do."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        if request is None:
            raise
        note = (f"ProTrain: profiling runs the eager model (torch.compile, asked by {request.source}, "
                f"is applied to the blocks after planning), so compile is not what failed here. "
                f"Check that the model trains eagerly without ProTrain (\"protrain\": "
                f"{{\"enabled\": false}}) and report this if it does")
        if not hasattr(e, "add_note"):            # Python 3.10
            raise RuntimeError(f"{note}: {type(e).__name__}: {e}") from e
        e.add_note(note)
        raise

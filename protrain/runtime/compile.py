"""torch.compile under a ProTrain plan: the blocks' forwards are compiled one by one.

Between two blocks the runtime moves chunks (uploads, releases, gradient offloads from
backward hooks on the block's input and output) and switches block modes (checkpoint, the
saved-tensor hooks of SWAP / SSD). None of that can be inside a graph: it mutates where the
parameters' storage is. So the graphs end at the block boundaries, and since torch refuses a
graph break inside a loop (the model's loop over its blocks: the whole frame then runs eager),
the compiled regions are the blocks' own ``forward``:

- a NONE, SWAP or SSD block calls its compiled forward; autograd's saved tensors of the
  compiled graph go through the runtime's saved-tensor hooks as in eager mode (parameter
  placeholders, the host / NVMe stash), so the modes work unchanged;
- a CKPT block runs torch's non-reentrant checkpoint around its compiled forward (the
  recompute calls the same compiled code again);
- a SELECTIVE block, and every block of a sequence-parallel plan, run eager (``eager_reason``).

All blocks of one class share one compiled graph (the parameters are graph inputs, read where
they are at each call), so moving chunks between steps recompiles nothing. The code around the
blocks (embeddings, final norm, head, loss) runs eager.

Where the request comes from (``CompileRequest``): ``torch.compile(model)`` or
``module.compile()`` taken off the model (``take_compiled``), or the framework's own compile
call (DeepSpeed's ``engine.compile()``, which the Hugging Face Trainer calls for
``torch_compile=True``). The profiler always sees the eager model.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from ..block_mode import BlockMode
from .boundaries import block_positions
from .forward_patches import ForwardPatches

log = logging.getLogger("protrain")


@dataclass(frozen=True, kw_only=True, slots=True)
class CompileRequest:
    """torch.compile as the user asked for it; ProTrain applies it to each block's forward."""

    backend: str
    """The backend's name ("inductor", "aot_eager", a custom backend's function name)."""
    source: str
    """How it was asked for, as the user wrote it: "torch.compile(model)", "engine.compile()"..."""
    fullgraph: bool = False
    """Each compiled block forward must be one graph (the model as a whole cannot be: chunks
    move and block modes switch between blocks)."""
    dynamic: bool | None = None
    """torch.compile's ``dynamic`` (None: decided by torch after a shape changes)."""
    wrap: Callable[[Callable], Callable] = field(repr=False, compare=False)
    """Compiles one function as asked: the user's own dynamo context when the request was
    taken off a compiled module, else torch.compile with the given options."""
    changed: str = ""
    """What ProTrain changed in the request, and why (empty: nothing)."""

    @classmethod
    def from_options(cls, backend, source: str, **options) -> "CompileRequest":
        """A request from torch.compile's arguments (``backend``: a name or a compiler function;
        ``options``: mode, options, dynamic, fullgraph...)."""
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
        changed = ""
        if name == "inductor" and _CUDAGRAPH_MODES.get(options.get("mode")):
            changed = (f"mode {_CUDAGRAPH_MODES[options['mode']]} instead of {options['mode']}: "
                       f"{_NO_CUDAGRAPHS}")
            options = dict(options, mode=_CUDAGRAPH_MODES[options["mode"]])
        if (options.get("options") or {}).get("triton.cudagraphs"):
            options = dict(options, options={**options["options"], "triton.cudagraphs": False})
            changed = f"triton.cudagraphs off: {_NO_CUDAGRAPHS}"
        return cls(backend=name, source=source, fullgraph=bool(options.get("fullgraph", False)),
                   dynamic=options.get("dynamic"), changed=changed,
                   wrap=functools.partial(torch.compile, backend=backend, **options))

    @classmethod
    def from_compiled(cls, compiled, source: str) -> "CompileRequest":
        """The request behind a compiled module (``OptimizedModule``) or the compiled call of
        ``module.compile()``: its dynamo context, which holds the backend with its mode and
        options, ``fullgraph`` and ``dynamic``."""
        ctx = _dynamo_context(compiled)
        if ctx is None:
            log.warning("protrain: could not read the options of %s (this torch version keeps them "
                        "elsewhere); the blocks are compiled with torch.compile's defaults", source)
            return cls.from_options("inductor", source)
        backend = getattr(ctx, "callback", None)
        for _ in range(8):      # dynamo's frame converters wrap the backend, each keeping the next
            inner = getattr(backend, "_torchdynamo_orig_backend", None)
            if inner is None:
                break
            backend = inner
        name = str(getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None) or "inductor")
        fullgraph, dynamic = bool(getattr(ctx, "fullgraph", False)), getattr(ctx, "_dynamic", None)
        config = getattr(backend, "config", None)
        if name == "inductor" and isinstance(config, dict) and config.get("triton.cudagraphs"):
            # The inductor wrapper keeps its mode as the options it implies: rebuild it without
            # CUDA graphs, everything else as asked.
            return cls(backend=name, source=source, fullgraph=fullgraph, dynamic=dynamic,
                       changed=f"triton.cudagraphs off: {_NO_CUDAGRAPHS}",
                       wrap=functools.partial(torch.compile, backend="inductor", fullgraph=fullgraph,
                                              dynamic=dynamic,
                                              options={**config, "triton.cudagraphs": False}))
        return cls(backend=name, source=source, fullgraph=fullgraph, dynamic=dynamic, wrap=ctx)

    def describe(self) -> str:
        extra = "".join([", fullgraph per block" if self.fullgraph else "",
                         f", dynamic={self.dynamic}" if self.dynamic is not None else "",
                         f"; {self.changed}" if self.changed else ""])
        return f"{self.source}, backend {self.backend}{extra}"


_CUDAGRAPH_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
"""Inductor modes that capture CUDA graphs, and the same mode without them."""
_NO_CUDAGRAPHS = ("a CUDA graph replays fixed addresses, and ProTrain moves parameters between "
                  "chunk buffers")


def _dynamo_context(compiled):
    """The dynamo context (torch._dynamo.eval_frame.OptimizeContext) that made ``compiled``:
    an OptimizedModule keeps it as ``dynamo_ctx``; a compiled function holds it in its closure
    (torch keeps no public handle on it; None when this torch keeps it elsewhere)."""
    ctx = getattr(compiled, "dynamo_ctx", None)
    if ctx is not None:
        return ctx
    code, cells = getattr(compiled, "__code__", None), getattr(compiled, "__closure__", None)
    if code is None or not cells:
        return None
    for name, cell in zip(code.co_freevars, cells):
        if name == "self" and callable(getattr(cell, "cell_contents", None)) and \
                hasattr(cell.cell_contents, "callback"):
            return cell.cell_contents
    return None


def _is_optimized_module(m) -> bool:
    return isinstance(m, torch._dynamo.eval_frame.OptimizedModule)


def take_compiled(model: nn.Module) -> tuple[nn.Module, CompileRequest | None]:
    """The eager model and the compile request its wrappers held: ``torch.compile(model)`` is
    unwrapped (its ``_orig_mod``), compiled submodules (``torch.compile(block)`` put back into
    the model) are replaced by their originals, and ``module.compile()`` (the model's or a
    submodule's, e.g. accelerate's regional compilation) is undone. The first request found
    (the outermost) is returned; None if nothing was compiled."""
    request = None
    while _is_optimized_module(model):
        request = request or CompileRequest.from_compiled(model, "torch.compile(model)")
        model = model._orig_mod
    for prefix, module in list(model.named_modules()):
        for name, child in list(module._modules.items()):
            while _is_optimized_module(child):
                request = request or CompileRequest.from_compiled(
                    child, f"torch.compile({prefix + '.' if prefix else ''}{name})")
                child = child._orig_mod
                module._modules[name] = child
    for name, module in model.named_modules():
        compiled = module.__dict__.get("_compiled_call_impl")
        if compiled is not None:
            request = request or CompileRequest.from_compiled(
                compiled, f"{name or 'model'}.compile()")
            module._compiled_call_impl = None
    return model, request


def eager_reason(mode: BlockMode, sequence_parallel: int = 1) -> str | None:
    """Why a block in ``mode`` runs eager under torch.compile (None: it is compiled)."""
    if sequence_parallel > 1:
        return (f"Ulysses attention (sequence_parallel={sequence_parallel}) intercepts attention "
                f"with a torch function mode around the block's forward, which is not compiled")
    if mode == BlockMode.SELECTIVE:
        return ("selective checkpointing picks the operator outputs to keep in a dispatch mode, "
                "which does not see inside compiled kernels")
    return None


class CompiledBlocks:
    """The blocks' forwards compiled by ``request`` while it is open (the blocks whose mode
    cannot be compiled keep their eager forward); ``close`` puts the forwards back. Opened
    before the activation modes wrap the forwards (checkpoint goes around the compiled code)
    and closed after they are unwrapped."""

    def __init__(self, blocks: Sequence[nn.Module], modes: Sequence[BlockMode],
                 request: CompileRequest | None, sequence_parallel: int = 1):
        self.blocks = list(blocks)
        self.request = request
        self.compiled: list[int] = []
        """Indices of the blocks whose forward is compiled."""
        self.eager: dict[int, str] = {}
        """Blocks running eager under a compile request, with the reason."""
        self._patches = ForwardPatches()
        if request is None:
            return
        # A module listed at several positions (shared weights) has one forward: compiled once,
        # and only if no position of it must run eager.
        for ps in block_positions(self.blocks).values():
            b = self.blocks[ps[0]]
            why = next((w for w in (eager_reason(modes[i], sequence_parallel) for i in ps) if w), None)
            if why is not None:
                self.eager.update({i: why for i in ps})
                continue
            self._patches.replace(b, request.wrap(b.forward))
            self.compiled.extend(ps)
        self.compiled.sort()

    def close(self) -> None:
        self._patches.restore()

    def summary(self) -> str | None:
        """One line saying what is compiled and what runs eager, and why (None: no request)."""
        if self.request is None:
            return None
        n = len(self.blocks)
        line = (f"ProTrain: torch.compile ({self.request.describe()}): the forward of {len(self.compiled)} "
                f"of {n} blocks compiled, graphs ending at block boundaries (chunks move and block "
                f"modes switch there); embeddings, head and loss run eager")
        by_reason: dict[str, list[int]] = {}
        for i, why in sorted(self.eager.items()):
            by_reason.setdefault(why, []).append(i)
        for why, blocks in by_reason.items():
            line += f"; block(s) {_ranges(blocks)} run eager: {why}"
        return line


def _ranges(ints: list[int]) -> str:
    out, start = [], None
    for k, i in enumerate(ints):
        if start is None:
            start = i
        if k + 1 == len(ints) or ints[k + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ",".join(out)

"""ProTrainRuntime: executes a Plan on a model, framework-neutral.

It owns the chunks (``chunks``), the gradient/optimizer path (``optimizer``) and the block
activation modes (``activations``), and drives them from the part boundaries of every
iteration:

forward, entering part p:  release chunks whose last user was before p; make part p's chunks
    resident; prefetch the following chunks into free buffers; note which block is running
    (swap bookkeeping, the mode of a module listed at several positions). A block called
    again right after itself enters its part again: a chunk it let go takes back a buffer
    from the prefetched chunk needed last.
backward, entering part p: part p+1 is done, so chunks first used there have all their
    gradients: offload them (and start CPU Adam if it may overlap); make part p's chunks
    resident (reused if still cached, re-uploaded otherwise); prefetch the next ones; start
    bringing back the previous block's swapped activations.
end of backward:           the remaining chunks' gradients are complete.

The public surface adapters stop at: ``forward_context()``, ``begin_backward()``,
``finish_backward()`` and ``step()`` for each iteration; ``export_state()`` on the runtime a
re-plan replaces and ``import_state()`` on the one built for the new plan (or from a
checkpoint's states); ``trainable_change()`` before a training forward (a change of
requires_grad needs a layout built for the new set: trainable.py); ``close()``; and the optimizer's events (``runtime.optimizer``:
``can_redo_micro_batch``, ``holds_accumulated_gradients``, ``discard_gradients``,
``scale_gradients``, ``zero_grad``, ``sync``). What the runtime is told besides its plan is in
``options.py``.
"""
from __future__ import annotations

import bisect
from contextlib import ExitStack, contextmanager
from typing import Sequence

import torch
from torch import nn

from ..block_mode import BlockMode
from ..plan import Plan
from ..state_tier import nvme_chunk_ids
from .meter import OpRecorder, StorageMeter, StorageRegistry, storage_ptr
from .activations import ActivationRuntime
from .adam import CPUAdamKernel, NativeCPUAdamKernel, TorchAdamKernel
from .boundaries import part_boundaries, position_names
from .chunks import ChunkManager, ChunkState
from .collectives import DataParallel
from .compile import CompiledBlocks, CompileRequest
from .full_state import FullStateDict
from .host_limits import check_pinning
from .nvme_states import NvmeStates
from .optimizer import ChunkOptimizer, StepState
from .options import OptimizerSetup, RuntimeOptions
from .outside import OutsideForwards, path_to_blocks
from .states import RuntimeState, assemble, export_pieces, import_pieces, redistribute
from .streams import Streams
from .tiled_head import HeadTiling
from .tiled_mlp import MLPTiling
from .trainable import TrainableChange, TrainableWatch


def _planned_params(model: nn.Module, param_names: list[str], setup: OptimizerSetup):
    """(name, parameter) of each parameter the plan names, in its order, and each trainable
    parameter's optimizer param group; a plan made for another model, or before a freeze, or
    a parameter the optimizer was not given, is refused naming it."""
    named = dict(model.named_parameters())
    missing = [n for n in param_names if n not in named]
    if missing:
        raise ValueError(f"the plan names parameters the model does not have: {missing[:3]}; "
                         f"it was made for another model (delete the plan file to re-plan)")
    group_of = {p: gi for gi, g in enumerate(setup.param_groups) for p in g["params"]}
    params = [(n, named[n]) for n in param_names]
    frozen = [n for n, p in params if not p.requires_grad]
    if frozen:
        raise ValueError(f"the plan trains parameters {frozen[:3]}, which are frozen "
                         f"(requires_grad=False) in this model; it was made before they were "
                         f"frozen (delete the plan file to re-plan)")
    absent = [n for n, p in params if p not in group_of]
    if absent:
        raise ValueError(f"parameters {absent[:3]} are trainable but in no optimizer param group; "
                         f"give every trainable parameter to the optimizer or freeze it")
    return params, group_of


class ProTrainRuntime:
    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module], plan: Plan, device: torch.device,
                 setup: OptimizerSetup, options: RuntimeOptions = RuntimeOptions()):
        """Put ``model``'s trainable parameters into ``plan``'s chunks (its layout of the
        parameters it names) and hook up ``blocks`` (the model's transformer blocks, in order)
        to run the plan's block modes."""
        self.model = model
        self.blocks = list(blocks)
        self.plan = plan
        self.layout = layout = plan.layout()
        param_names = [r.name for r in plan.params]
        self.device = device
        self.setup = setup
        self.options = options
        self.is_boundary = options.is_boundary
        accounting = options.accounting
        self.n_parts = len(self.blocks) + 2
        self.streams = Streams(device)
        params, group_of = _planned_params(model, param_names, setup)
        self.head_tiling = HeadTiling(model, plan.knobs.head_tile) if plan.knobs.head_tile else None
        """The plan's tiled head and loss (tiled_head.py), entered by training forwards with
        labels (``forward_context``); None: the model's own head."""
        self.trainable = TrainableWatch(model)
        """The requires_grad flags the chunks are built for (checked at every training forward
        and backward: trainable.py)."""
        # All the host memory the plan holds, refused before any of it is taken (not part-way
        # through, nor by the OOM killer once the pages are touched).
        check_pinning(plan.prediction.host_bytes, "the plan's host memory (offloaded chunks' "
                      "states, swapped activations)")
        nvme_ids = nvme_chunk_ids(layout.n_chunks, plan.knobs.n_persist, plan.knobs.n_nvme)
        nvme = NvmeStates(nvme_ids, options.ssd_root, self.streams, device,
                          speculative=setup.clip > 0 or setup.loss_scaler is not None,
                          verify=options.ssd_verify is not False) if nvme_ids else None
        # Where each parameter was: a pinned allocation the host cannot give part way puts the
        # parameters back there (``_unbuild``), out of the half-built chunks.
        before = [(p, p.device) for _, p in params]
        try:
            self.chunks = ChunkManager(
                named_params=params, param_chunk=list(layout.param_chunk),
                chunk_parts=list(zip(layout.chunk_first_part, layout.chunk_last_part)),
                n_persist=plan.knobs.n_persist, n_buffer=plan.knobs.n_buffer,
                chunk_capacity=layout.chunk_numel, group_of=group_of, device=device,
                streams=self.streams, grad_accumulation=setup.grad_accumulation_steps > 1,
                dp=options.dp, nvme=nvme, n_shard=plan.knobs.n_shard)
        except BaseException:
            self._unbuild(before, nvme)
            raise
        host_kernel, device_kernel = adam_kernels(device, setup, bool(self.chunks.offloaded()))
        self.accounting = DeviceAccounting(device) if accounting else None
        in_order = [p for p in model.parameters() if p.requires_grad]
        try:
            self.optimizer = ChunkOptimizer(
                self.chunks, self.streams, setup, host_kernel=host_kernel, device_kernel=device_kernel,
                params_in_order=in_order, pause_accounting=self.accounting.paused if self.accounting else None)
        except BaseException:
            self._unbuild(before, nvme)
            raise
        self._buffer_index = {t.data_ptr(): b for b, t in enumerate(self.chunks.pool.tensors)}
        self._persistent = [c for c in self.chunks.chunks if c.persistent]
        self._persistent_ptrs = {c.data.data_ptr() for c in self._persistent}
        self._slot_offsets = {c.index: [s.offset for s in c.slots] for c in self.chunks.chunks}
        # Compiled before the activation modes wrap the forwards: checkpoint goes around the
        # compiled code, and the saved-tensor hooks see what the compiled graphs save.
        self.compiled = CompiledBlocks(self.blocks, plan.block_modes, options.compile,
                                       plan.knobs.sequence_parallel)
        self.mlp_tiling: MLPTiling | None = None
        try:
            # For the runtime's life, not per forward: a checkpointed block's recompute (in
            # backward, outside any forward) must tile as its forward did.
            self.mlp_tiling = plan.knobs.mlp_tile and MLPTiling(self.blocks, plan.knobs.mlp_tile,
                                                                 with_norm=plan.mlp_with_norm).install() or None
            self.activations = ActivationRuntime(
                self.blocks, plan.block_modes, self.streams, device, plan.block_saved_bytes,
                self._param_lookup, ssd_root=options.ssd_root, ssd_verify=options.ssd_verify is True,
                ssd_min_bytes=options.ssd_min_bytes, input_bytes=plan.block_input_bytes)
        except BaseException:
            self.compiled.close()
            if self.mlp_tiling is not None:
                self.mlp_tiling.remove()
            self.optimizer.worker.close()
            self._unbuild(before, nvme)
            raise
        del before
        self._needs_saved_hooks = bool(self.chunks.streamed()) or any(
            m in (BlockMode.SWAP, BlockMode.SSD, BlockMode.CKPT_HOST, BlockMode.CKPT_SSD)
            for m in plan.block_modes)
        self._hooks = ExitStack()
        self._bounds = self._hooks.enter_context(part_boundaries(self.blocks, self._on_enter,
                                                                 position_names(model, self.blocks)))
        for _, p in params:
            self._hooks.callback(p.register_post_accumulate_grad_hook(self.optimizer.on_grad).remove)
        # The module's weights read through state_dict wait for the last step's host updates
        # (offloaded parameters are views of host memory CPU Adam may still be writing) and,
        # sharded over ranks, are gathered (every rank calls it; full_state.py).
        self.full_state = FullStateDict(model, self.chunks, timeout_s=options.gather_timeout_s,
                                        fix=options.save_fix)
        self._hooks.callback(self.full_state.remove)
        # A forward of the model that does not come through the engine (generate, module(x)).
        self._forward_depth = 0
        outside = OutsideForwards(path_to_blocks(model, self.blocks), self.forward_context,
                                  lambda: self._forward_depth > 0, options.outside_forward)
        self._hooks.callback(outside.remove)
        self._part_chunks = [[self.chunks.chunks[c] for c in cs] for cs in layout.part_chunks]
        self._in_backward = False
        self.tracer = self._open_trace(options.trace_file, plan, device, accounting)
        self.chunks.tracer = self.optimizer.tracer = self.tracer
        self._next_up = 0
        self._next_down = len(self.chunks.chunks) - 1
        self.iterations = 0
        self._chain_at_import = (1, 0)
        """The host Adam kernels' beta^t as imported (``RuntimeState.adam_chain``)."""
        self._steps_at_import = 0

    # ---- lifecycle ------------------------------------------------------------------------
    def _unbuild(self, before: list[tuple[nn.Parameter, torch.device]], nvme: NvmeStates | None) -> None:
        """Undo a build that failed part way (pinned memory the host could not give): else the
        parameters would stay views of half-built chunks, and what was pinned so far would
        stay registered for the life of the process. Each parameter gets a tensor of its own
        back, with its values, on its device (copied out of its chunk: the build frees each
        parameter's memory once its chunk holds it, so a model that fits is not held twice);
        the NVMe store is closed (its I/O done before its buffers go)."""
        for p, device in before:
            p.data = p.data.to(device, copy=True)
        if nvme is not None:
            nvme.close()
        self.streams.release_pinned()

    def close(self, to_host: bool = False, gather: bool = True) -> None:
        """Undo everything: hooks, wrapped block forwards; parameters become standalone
        tensors again with their current values (on the host with ``to_host``)."""
        self.optimizer.wait_collectives()
        self.optimizer.worker.drain()
        self.optimizer.worker.close()
        if self.tracer is not None:
            self.tracer.close()
        self._hooks.close()
        self.activations.close()
        self.compiled.close()
        if self.mlp_tiling is not None:
            self.mlp_tiling.remove()
        if self.accounting is not None:
            self.accounting.end(0)
        self.chunks.close(to_host, gather)

    def set_compile(self, request: CompileRequest | None) -> None:
        """Compile the blocks' forwards with ``request`` from now on (None: eager again)."""
        self.activations.unwrap_blocks()
        self.compiled.close()
        self.compiled = CompiledBlocks(self.blocks, self.plan.block_modes, request,
                                       self.plan.knobs.sequence_parallel)
        self.activations.wrap_blocks()

    @contextmanager
    def forward_context(self, args=(), kwargs=None):
        """Wrap one forward pass (the model's forward, and the loss if computed outside).
        ``args`` / ``kwargs``: the model's inputs, which say whether a training forward
        computes its loss from labels (then the plan's tiled head computes it)."""
        self._begin_forward()
        self._forward_depth += 1
        try:
            with ExitStack() as stack:
                if self.accounting is not None:
                    self.accounting.begin()
                if self._needs_saved_hooks:
                    stack.enter_context(self.activations.hooks())
                tiling = self.head_tiling
                if tiling is not None and torch.is_grad_enabled() and self.model.training and \
                        tiling.wants(args, kwargs or {}):
                    stack.enter_context(tiling.active())
                yield
        finally:
            self._forward_depth -= 1
        self.activations.enter_forward_block(None)

    def begin_backward(self) -> None:
        """Backward is about to start (called by the framework): bring the last block's
        swapped activations back while the head's backward runs."""
        # The forward's graph decided which gradients exist: a change since cannot be honoured.
        self.trainable.check("this backward")
        self.activations.backward_start()

    def trainable_change(self) -> TrainableChange | None:
        """Which parameters were frozen or unfrozen since the chunks were built (None: none):
        an adapter moves to a layout for the new set before the next training forward."""
        return self.trainable.change()

    def _open_trace(self, trace_file: str | None, plan: Plan, device: torch.device, accounting: bool):
        """The recorder of the run's timeline (``options.trace_file``), or None."""
        if not trace_file:
            return None
        from .timeline_recorder import TimelineRecorder
        memory = (lambda: torch.cuda.memory_allocated(device)) if device.type == "cuda" else (
            (lambda: self.chunks.device_bytes() + getattr(getattr(self.accounting, "registry", None),
                                                          "live_bytes", 0)) if accounting else None)
        k = plan.knobs
        return TimelineRecorder(trace_file, memory=memory, title=(
            f"{len(self.chunks.offloaded())} of {len(self.chunks.chunks)} chunks offloaded, "
            f"{len(self.chunks.sharded())} sharded, blocks "
            f"ckpt {k.n_checkpoint} swap {k.n_swap} ssd {k.n_ssd} sel {k.n_selective}"))

    def step_counts(self) -> dict[str, int]:
        """Adam steps taken by each parameter in the chunks (on every rank, whatever its shard)."""
        return {s.name: s.step for c in self.chunks.chunks for s in c.slots}

    def _begin_forward(self) -> None:
        if not torch.is_grad_enabled() and self.chunks.dp.world > 1 and any(
                c.shard_size < c.numel for c in self.chunks.streamed()):
            # A forward without gradients (evaluation, samples) may run on some ranks only; its
            # uploads gather shards from every rank: meet first, so one rank alone fails by name
            # after the timeout instead of waiting in the gather for ever.
            self.chunks.dp.rendezvous(
                "a forward pass without gradients (evaluation, generate)",
                timeout_s=self.options.gather_timeout_s,
                fix="Run evaluation and generate on every rank, and print on one, as with ZeRO-3 "
                    "(generate(..., synced_gpus=True): ranks that finish early keep stepping).")
        if torch.is_grad_enabled():       # an evaluation forward trains nothing: any layout runs it
            self.trainable.check("this training forward")
        if self._in_backward:
            self.finish_backward()
        self.optimizer.pre_forward()
        if self.accounting is not None:
            self.accounting.end(self.chunks.device_bytes())
        for c in self.chunks.streamed():      # a forward without backward (evaluation)
            if c.state == ChunkState.RESIDENT:
                self.chunks.release(c)
            elif c.state == ChunkState.UPLOADING:
                self.chunks.access(c)
                self.chunks.release(c)
        self.activations.reset()
        self._next_up = 0
        self._bounds.begin_forward()
        self._enter_forward(0)

    def finish_backward(self) -> None:
        """All gradients of this micro-batch exist (idempotent): offload what is still on the
        device. Runs at the end of autograd's backward and again from the framework's
        backward epilogue."""
        boundary = self.is_boundary()
        if self.tracer is not None:
            self.tracer.end_backward()
        for c in self.chunks.streamed():
            # After a backward every resident chunk is done, gradients or not (zeros then: Adam
            # steps every parameter); the same on every rank, whose reduce-scatters must pair
            # up. Outside one (no part boundary was crossed) only chunks that got gradients.
            if c.state == ChunkState.RESIDENT and (self._in_backward or any(s.has_grad for s in c.slots)):
                self.optimizer.chunk_backward_done(c, boundary)
        for c in self._persistent:
            self.optimizer.persistent_backward_done(c, boundary)
        if self._in_backward:
            self.activations.reset()
        if boundary and self.optimizer.step_state is not StepState.IDLE:
            self.optimizer.boundary_backward_done = True
        self._in_backward = False

    def step(self) -> None:
        """The optimizer step at the accumulation boundary."""
        self.finish_backward()
        if self.accounting is not None:
            self.accounting.end(self.chunks.device_bytes())
        self.optimizer.step()
        self.iterations += 1

    def export_state(self, *, grads: bool = False) -> RuntimeState:
        """This rank's model states - weights, fp32 masters, Adam moments, step counts, and
        with ``grads`` the gradients accumulated in this optimizer step - for ``import_state``
        of the runtime a re-plan builds; the last thing asked of this runtime before ``close``.
        Without ``grads`` the step's gradients are dropped here (the micro-batch in progress is
        redone from its start). The host updates and the device's queued work finish first.
        A collective with ``grads`` and several ranks (``export_pieces``)."""
        self.optimizer.sync()                     # CPU Adam of the last step
        self.streams.synchronize()                # copies into the gradient regions included
        if not grads:
            self.optimizer.discard_gradients()    # this micro-batch's partial gradients
        return RuntimeState(pieces=export_pieces(self.chunks, grads=grads), grads=grads,
                            adam_chain=self.adam_chain())

    def import_state(self, state: RuntimeState, *, exchange: DataParallel | None = None) -> None:
        """Take ``state`` (another runtime's ``export_state``, or a checkpoint's pieces) into
        this runtime's chunks, whatever their layout or sharding, and go on from it bit for
        bit: the Adam kernels primed to its step counts; the gradients it carries accumulated
        onto, or without any every gradient of this runtime cleared. One rank's export with
        several ranks is first exchanged over ``exchange`` (host tensors: a gloo group), so
        each rank gets what its chunks hold now: a collective then."""
        pieces = state.pieces
        if state.local and self.chunks.dp.world > 1:
            if exchange is None:
                raise ValueError(f"import_state: the state holds one rank's pieces and the runtime "
                                 f"runs on {self.chunks.dp.world} ranks; pass exchange= (a host-side "
                                 f"group, collectives.host_side) to send each rank what it holds")
            pieces = redistribute(pieces, self.chunks, exchange)
        by_name: dict = {}
        for piece in pieces:
            by_name.setdefault(piece.name, []).append(piece)
        import_pieces(self.chunks, lambda n, lo, hi: assemble(by_name, n, lo, hi),
                      optimizer_states=state.optimizer_states, grads=state.grads)
        self._prime_kernels(state.adam_chain)
        if state.grads:
            self.optimizer.carry_gradients()
        else:
            self.optimizer.discard_gradients()

    def _prime_kernels(self, chain: tuple[int, int] | None) -> None:
        """After states were imported (checkpoint, re-plan): bring the Adam kernels to where the
        run that made them left its kernels (``chain``; None: an uninterrupted run to the
        largest step count), so training continues bit for bit."""
        steps = self._largest_step()
        chain = chain or (1, steps)
        hyper = self.setup.hyper(self.setup.param_groups[0])
        for kernel in {id(k): k for k in (self.optimizer.host_kernel, self.optimizer.device_kernel)
                       if k is not None}.values():
            kernel.prime(chain[1], hyper, pow_at=chain[0])
        self._chain_at_import, self._steps_at_import = chain, steps

    def _largest_step(self) -> int:
        return max((s.step for c in self.chunks.chunks for s in c.slots), default=0)

    def adam_chain(self) -> tuple[int, int]:
        """The host Adam kernels' beta^t as ``RuntimeState.adam_chain`` records it (exports
        carry it; a checkpoint stores it beside the pieces): (the step whose beta^t they last
        computed with pow(), the step of their last update). The C++ kernel keeps beta^t and
        multiplies it by beta when the step advances by one, recomputing it with pow() when the
        step jumps (the bits differ). A step count that restarts or resumes (a param group's
        under DeepSpeed's FusedAdam after its last parameter was frozen or unfrozen,
        protrain_ds/trainable.py) jumps at the first update after an import, and only there:
        within a layout every parameter steps together."""
        pow_at, last = self._chain_at_import
        now = self._largest_step()
        if now == self._steps_at_import:
            return pow_at, last
        first = self._steps_at_import + 1
        return (pow_at if first in (last, last + 1) else first), now

    # ---- boundaries -----------------------------------------------------------------------
    def _on_enter(self, phase: str, part: int, tensor) -> None:
        if self.tracer is not None:
            self.tracer.part(phase, f"part {part}")
        if phase == "fwd":
            self._enter_forward(part)
        else:
            self._enter_backward(part)

    def _block_of(self, part: int) -> int | None:
        return part - 1 if 1 <= part <= len(self.blocks) else None

    def _enter_forward(self, part: int) -> None:
        # The post part counts as "block N" for the swap throttle (one block in flight).
        self.activations.forward_part(part)
        for c in self.chunks.streamed():
            if c.last_part < part:
                self.chunks.release(c)
        for c in self._part_chunks[part]:
            if c.state == ChunkState.HOST and not self.chunks.can_upload():
                self._unprefetch(part)
            self.chunks.access(c)
        self._prefetch_forward(max((c.index for c in self._part_chunks[part] if not c.persistent),
                                   default=self._next_up - 1) + 1)

    def _unprefetch(self, part: int) -> None:
        """A part entered again (a block called again right after itself) needs a chunk it let
        go, and the prefetch has taken every buffer: give back the buffer of the prefetched
        chunk needed last (it stays cached there until taken, else is uploaded again)."""
        mine = set(map(id, self._part_chunks[part]))
        ahead = [c for c in self.chunks.streamed() if id(c) not in mine
                 and c.state in (ChunkState.RESIDENT, ChunkState.UPLOADING)]
        if ahead:
            c = max(ahead, key=lambda c: c.index)
            self.chunks.access(c)           # its upload finished before the buffer is reused
            self.chunks.release(c)

    def _prefetch_forward(self, start: int) -> None:
        """Upload the next chunks into the free buffers, in order, up to the first one whose
        CPU Adam update (carried over from the last step) is still running: waiting for it
        here would hold back the kernels of the part being entered, which the persistent
        chunks' compute should hide it behind. The next part's entry tries again; only a
        chunk a part needs now is waited for (``access``)."""
        self._next_up = max(self._next_up, start)
        chunks = self.chunks.chunks
        while self._next_up < len(chunks) and self.chunks.can_upload():
            c = chunks[self._next_up]
            if not c.persistent:
                if c.state == ChunkState.HOST and not self.chunks.host_ready_now(c):
                    break
                self.chunks.upload(c)
            self._next_up += 1

    def _enter_backward(self, part: int) -> None:
        if not self._in_backward:
            self._in_backward = True
            self._next_down = len(self.chunks.chunks) - 1
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        boundary = self.is_boundary()
        for c in self.chunks.streamed():
            if c.first_part > part and c.state == ChunkState.RESIDENT:
                self.optimizer.chunk_backward_done(c, boundary)
        for c in self._persistent:
            if c.first_part > part:
                # Its gradients are complete: their all-reduce runs under the rest of backward.
                self.optimizer.persistent_backward_done(c, boundary)
        self.activations.backward_done_with(part)
        for c in sorted(self._part_chunks[part], key=lambda c: -c.index):
            self.chunks.access(c)
        low = min((c.index for c in self._part_chunks[part] if not c.persistent),
                  default=self._next_down + 1)
        self._prefetch_backward(low - 1, part)
        self.activations.backward_prefetch(part)   # after the chunk uploads: one upload FIFO

    def _prefetch_backward(self, start: int, part: int) -> None:
        self._next_down = min(self._next_down, start)
        chunks = self.chunks.chunks
        while self._next_down >= 0 and self.chunks.can_upload():
            c = chunks[self._next_down]
            # Not a chunk whose backward is over (first used after ``part``): its gradients
            # have left, and a copy uploaded now would hold its weights from before the update.
            if not c.persistent and c.state in (ChunkState.HOST, ChunkState.CACHED) and c.first_part <= part:
                self.chunks.upload(c)
            self._next_down -= 1

    # ---- saved parameter views ------------------------------------------------------------
    def _param_lookup(self, t: torch.Tensor):
        """(param, offset within it) if ``t`` views a parameter in a chunk buffer; True if it
        views a persistent chunk (kept as is: it never moves); None otherwise."""
        ptr = storage_ptr(t)
        if ptr in self._persistent_ptrs:
            return True
        b = self._buffer_index.get(ptr)
        if b is None:
            return None
        c = self.chunks.pool.owner[b]
        if c is None:
            return None
        offs = self._slot_offsets[c.index]
        i = bisect.bisect_right(offs, t.storage_offset()) - 1
        if i < 0:
            return None
        s = c.slots[i]
        return s.param, t.storage_offset() - s.offset

    # ---- accounting -------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Where the offloaded chunks' optimizer states are now: ``host_state_bytes`` (in host
        memory: those not on NVMe, their speculation backups, and the staging ring the others
        pass through) and ``nvme_state_bytes`` (on the drive: one current copy of each chunk's
        states on NVMe; the file holds two places per chunk, ``nvme_file_bytes``)."""
        nvme = self.chunks.nvme
        return {"host_state_bytes": self.chunks.host_state_bytes() + self.optimizer.backup_bytes(),
                "nvme_state_bytes": nvme.state_bytes() if nvme is not None else 0,
                "nvme_file_bytes": nvme.file_bytes() if nvme is not None else 0}

    def device_peak(self) -> int:
        """Highest device bytes seen (accounting mode): chunk states + live activations."""
        if self.accounting is None:
            raise RuntimeError("device_peak() needs the runtime built with accounting=True")
        return self.accounting.peak


def adam_kernels(device: torch.device, setup: OptimizerSetup, offloaded: bool):
    """(host kernel, device kernel). DeepSpeed's CPU Adam (built by a compiler on first use) is
    made only where something runs on the host: offloaded chunks, or a CPU "device", whose
    Adam is the host one (same bits as DeepSpeed's). With every chunk on a GPU there is no
    host kernel, so a machine without a compiler trains all the same."""
    if device.type == "cuda":
        device_kernel = TorchAdamKernel(setup.torch_fused, setup.torch_foreach) if setup.torch_adam \
            else TorchAdamKernel(fused=True)
        return (host_kernel(device, setup) if offloaded else None), device_kernel
    # Two instances of the host kernel: the persistent chunks' updates (main thread) and the
    # offloaded ones' (the worker, a thread with ``host_thread``) interleave by timing, and the
    # C++ kernel keeps state per instance (step, beta^t; DeepSpeed's binding lr and bias
    # corrections too). Each follows DeepSpeed's own beta^t chain step by step: same bits.
    return host_kernel(device, setup), host_kernel(device, setup)


def uses_native_kernel(device: torch.device, setup: OptimizerSetup) -> bool:
    """Whether offloaded chunks are updated by csrc/cpu_adam.cpp (else DeepSpeed's or torch's)."""
    if setup.torch_adam:
        return False
    return setup.cpu_adam == "native" or (setup.cpu_adam == "auto" and device.type != "cpu")


def host_kernel(device: torch.device, setup: OptimizerSetup):
    if setup.torch_adam:
        return TorchAdamKernel(setup.torch_fused, setup.torch_foreach)
    threads = setup.cpu_adam_threads
    return NativeCPUAdamKernel(setup.adamw, threads) if uses_native_kernel(device, setup) \
        else CPUAdamKernel(setup.adamw, threads)


class DeviceAccounting:
    """The runtime's own count of device-resident bytes (for CPU tests, where there is no
    device allocator to ask): chunk states plus the storages operators allocate, with the
    runtime's host-side work (copies into host regions, CPU Adam) excluded."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0
        self.activation_peak = 0
        self._recorder = None

    def begin(self) -> None:
        if self._recorder is not None:
            return
        self.registry = StorageRegistry(self.device.type)
        top = [0]
        self._top = top
        self._recorder = OpRecorder(self.registry, StorageMeter(self.registry),
                                    lambda n, b, pk, a: top.__setitem__(0, max(top[0], pk)),
                                    {}, lambda i: None)
        self._recorder.__enter__()

    def stop(self, state_bytes: int = 0) -> None:
        """Stop counting and take the peak; safe from an autograd callback, whose thread state
        is not the forward's (the dispatch mode itself is left by ``end`` on the main thread)."""
        if self._recorder is None:
            return
        self.registry.paused = True
        self.activation_peak = max(self.activation_peak, self._top[0])
        self.peak = max(self.peak, state_bytes + self._top[0])

    def end(self, state_bytes: int) -> None:
        if self._recorder is None:
            return
        self._recorder.__exit__(None, None, None)
        self._recorder = None
        self.activation_peak = max(self.activation_peak, self._top[0])
        self.peak = max(self.peak, state_bytes + self._top[0])

    @contextmanager
    def paused(self):
        reg = getattr(self, "registry", None)
        if reg is None or self._recorder is None:
            yield
            return
        old = reg.paused
        reg.paused = True
        try:
            yield
        finally:
            reg.paused = old

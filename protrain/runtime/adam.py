"""Adam kernels that update flat chunk segments in place.

Reused, not rewritten: DeepSpeed's CPU Adam (the C++ kernel behind DeepSpeedCPUAdam, also
behind FusedAdam on DeepSpeed's CPU accelerator, so on CPU both give identical bits) for the
host; torch's fused AdamW for the device; torch's own single-tensor Adam/AdamW when the user
asked DeepSpeed for ``"torch_adam": true``.

DeepSpeed's CPU Adam computes a call's elements in SIMD blocks and its last few (fewer than a
block's width) in scalar code, whose rounding differs (no fused multiply-add). DeepSpeed calls
it once per parameter tensor; the chunk runtime calls it on runs of parameters and on the
pieces of a parameter a shard boundary splits. ``update_as_per_tensor`` gives every element
the code path DeepSpeed's own call gives it, whatever the run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim import adam as _torch_adam
from torch.optim import adamw as _torch_adamw

from .host_threads import omp_threads


SIMD_ELEMENTS = 16
"""Widest SIMD block of DeepSpeed's CPU Adam, in fp32 elements (AVX-512; AVX2 has 8, NEON 4:
all divide it). A call's elements from ``n - n % width`` on run its scalar loop."""


@dataclass(frozen=True, slots=True)
class AdamHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: bool
    adamw: bool
    """Decoupled weight decay (AdamW) rather than L2 added to the gradient (Adam)."""


class CPUAdamKernel:
    """DeepSpeed's vectorised CPU Adam on fp32 host tensors."""

    simd = True
    """SIMD blocks and a scalar tail (see the module docstring)."""

    def __init__(self, adamw: bool, threads: int = 0):
        self.pad = _pad_scratch()
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        from ..native import deepspeed_cpu_adam_op
        self._op = deepspeed_cpu_adam_op()           # built once per machine, loaded once
        # An optimizer of the C++ op under an id from DeepSpeedCPUAdam's own counter, without
        # a DeepSpeedCPUAdam: its constructor runs cpuinfo in a subprocess (about 1 s, for a
        # warning about fp16 parameters on AMD CPUs) at every runtime build and re-plan. The
        # hyperparameters given here are replaced by each update's.
        self._id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1
        self._op.create_adam(self._id, 1e-3, 0.9, 0.999, 1e-8, 0.0, adamw, False)
        self.threads = threads
        """OpenMP threads of an update (the rank's share of the node's cores,
        ``runtime.node``); 0: the calling thread's. DeepSpeed's kernel forks as many as the
        calling thread is set to (``host_threads``); each element's arithmetic is the same
        whatever the count, so the bits are too."""

    def update(self, master, grad, exp_avg, exp_avg_sq, step: int, h: AdamHyper, *,
               scale=None, grad_writable: bool = True, backup=()) -> None:
        """One step over a flat segment (the interface every kernel here has). ``scale``
        (None, or a one-element tensor on the gradients' device) multiplies the gradients
        first - in place where ``grad_writable``, else into a temporary; 16-bit gradients are
        widened into a temporary first. ``backup``: three tensors that receive master,
        exp_avg and exp_avg_sq as they were before."""
        with omp_threads(self.threads):
            g = _prepared_grad(master, grad, exp_avg, exp_avg_sq, scale, grad_writable, backup)
            self._op.adam_update(self._id, step, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay,
                                 h.bias_correction, master, g, exp_avg, exp_avg_sq)

    def __del__(self):
        try:
            self._op.destroy_adam(self._id)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def prime(self, steps_done: int, h: AdamHyper, *, pow_at: int = 1) -> None:
        """Put a fresh kernel in the state a long-running one has after ``steps_done`` steps.

        The C++ kernel keeps beta^t and, when the step advances by one, updates it by one
        multiplication (pow() only when it jumps). A kernel created after a restart would take
        pow() where the uninterrupted run multiplied, and differ in the last bit; empty
        updates rebuild the same value (microseconds each): pow() at ``pow_at`` (the step the
        run last jumped to; 1: it never jumped, and a fresh kernel's first step multiplies
        beta by 1, which is pow(beta, 1)), then one multiplication per step to ``steps_done``."""
        _prime(self, steps_done, h, pow_at)


class NativeCPUAdamKernel:
    """ProTrain's csrc/cpu_adam.cpp: DeepSpeed's SIMD Adam (same bits as CPUAdamKernel) with
    the Python GIL released for the whole update, so the training thread's backward hooks
    run meanwhile; it widens and scales the gradients tile by tile without writing them, and
    backs up master / exp_avg / exp_avg_sq in the same pass (a speculative update)."""

    _next_id = 1
    simd = True
    """SIMD blocks and a scalar tail, as DeepSpeed's (thread shares start on whole blocks)."""

    def __init__(self, adamw: bool, threads: int = 0):
        self.pad = _pad_scratch()
        from ..native import cpu_adam
        self._op = cpu_adam()
        self._id = NativeCPUAdamKernel._next_id
        NativeCPUAdamKernel._next_id += 1
        self._op.create(self._id, adamw)
        self.threads = threads or self._op.max_threads()
        """OpenMP threads of an update (``num_threads`` of its parallel region): the rank's
        share of the node's cores (``runtime.node``); 0 given: the constructing thread's."""

    def update(self, master, grad, exp_avg, exp_avg_sq, step: int, h: AdamHyper, *,
               scale=None, grad_writable: bool = True, backup=()) -> None:
        """As CPUAdamKernel.update, in one pass: the gradients are only ever read (widened and
        scaled tile by tile), whatever ``grad_writable`` allows."""
        self._op.update(self._id, step, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay,
                        h.bias_correction, master, grad, exp_avg, exp_avg_sq,
                        1.0 if scale is None else float(scale), list(backup), None, self.threads)

    def prime(self, steps_done: int, h: AdamHyper, *, pow_at: int = 1) -> None:
        """As CPUAdamKernel.prime: the same beta^t as the run that made the states."""
        _prime(self, steps_done, h, pow_at)

    def __del__(self):
        try:
            self._op.destroy(self._id)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class TorchAdamKernel:
    """torch's Adam/AdamW through the implementation torch.optim would take for the same tensors
    and flags (``fused``, ``foreach``; None: torch's default for the tensor's device -
    single-tensor on the CPU, for-each on CUDA), so results match a plain torch optimizer bit
    for bit."""

    simd = False
    """Every element the same arithmetic, however a segment is split."""

    def __init__(self, fused: bool | None = None, foreach: bool | None = None):
        self.fused = fused
        self.foreach = foreach

    def _flags(self, master: torch.Tensor) -> tuple[bool, bool]:
        if self.fused is not None or self.foreach is not None:
            return bool(self.fused), bool(self.foreach)
        try:
            from torch.optim.optimizer import _default_to_fused_or_foreach
            fused, foreach = _default_to_fused_or_foreach([master], False, False)
        except (ImportError, TypeError):          # another torch: its plain default
            fused, foreach = False, master.device.type == "cuda"
        return bool(fused), bool(foreach)

    def update(self, master, grad, exp_avg, exp_avg_sq, step: int, h: AdamHyper, *,
               scale=None, grad_writable: bool = True, backup=()) -> None:
        """As CPUAdamKernel.update."""
        grad = _prepared_grad(master, grad, exp_avg, exp_avg_sq, scale, grad_writable, backup)
        if not h.bias_correction:
            raise ValueError("torch's Adam always applies bias correction; set "
                             "\"bias_correction\": true or drop \"torch_adam\"")
        fused, foreach = self._flags(master)
        dev = master.device if fused else torch.device("cpu")
        # Incremented inside. A fill, not torch.tensor(): a host value copied to the device
        # with a blocking copy would synchronise with the compute stream on every update.
        step_t = torch.full((), float(step - 1), dtype=torch.float32, device=dev)
        fn = _torch_adamw.adamw if h.adamw else _torch_adam.adam
        fn([master], [grad], [exp_avg], [exp_avg_sq], [], [step_t], foreach=foreach,
           fused=fused, amsgrad=False, beta1=h.beta1, beta2=h.beta2, lr=h.lr,
           weight_decay=h.weight_decay, eps=h.eps, maximize=False)

    def prime(self, steps_done: int, h: AdamHyper, *, pow_at: int = 1) -> None:
        """Stateless between calls: nothing to restore."""


def _prime(kernel, steps_done: int, h: AdamHyper, pow_at: int) -> None:
    """Empty updates taking a fresh C++ kernel (its step 0) to beta^t = pow(beta, pow_at) times
    beta once per step after it, at ``steps_done``: the first jumps (pow) unless it is step 1."""
    if steps_done <= 0:
        return
    empty = torch.empty(0)
    for step in range(min(pow_at, steps_done), steps_done + 1):
        kernel.update(empty, empty, empty, empty, step, h)


def update_as_per_tensor(kernel, master, grad, exp_avg, exp_avg_sq, step: int, h: AdamHyper, *,
                         scalar_from: int, scale=None, grad_writable: bool = True, backup=()) -> None:
    """``kernel.update`` on a segment whose elements DeepSpeed's per-tensor calls compute in
    SIMD code before ``scalar_from`` and in scalar code from there (the tail of one parameter:
    fewer than SIMD_ELEMENTS). Split so that each element takes that path: the SIMD part in
    whole blocks, its remainder (a piece a shard boundary cut) padded to one block in the
    kernel's scratch, the scalar part alone (fewer elements than a block: all scalar)."""
    n = master.numel()
    whole = scalar_from - scalar_from % SIMD_ELEMENTS
    if not kernel.simd or n - n % SIMD_ELEMENTS == scalar_from:     # the call's own split
        kernel.update(master, grad, exp_avg, exp_avg_sq, step, h, scale=scale,
                      grad_writable=grad_writable, backup=backup)
        return

    def part(a: int, b: int):
        return (master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b]), [x[a:b] for x in backup]
    for a, b in ((0, whole), (scalar_from, n)):
        if a < b:
            states, bk = part(a, b)
            kernel.update(*states, step, h, scale=scale, grad_writable=grad_writable, backup=bk)
    if whole < scalar_from:
        (m, g, ea, eas), bk = part(whole, scalar_from)
        r = scalar_from - whole
        pad = kernel.pad                      # rows: master, grad, m, v, 3 backups; zero padded
        pad.zero_()
        for row, src in zip(pad, (m, g, ea, eas)):
            row[:r].copy_(src)
        kernel.update(pad[0], pad[1], pad[2], pad[3], step, h, scale=scale, grad_writable=True,
                      backup=list(pad[4:]) if bk else ())
        for dst, row in zip((m, ea, eas), (pad[0], pad[2], pad[3])):
            dst.copy_(row[:r])
        for dst, row in zip(bk, pad[4:]):
            dst.copy_(row[:r])


def _pad_scratch() -> torch.Tensor:
    """One SIMD block of master, gradient, exp_avg, exp_avg_sq and three backups (a kernel is
    called by one thread only: the worker's, or the main thread's)."""
    return torch.zeros(7, SIMD_ELEMENTS, dtype=torch.float32)


def _prepared_grad(master, grad, exp_avg, exp_avg_sq, scale, grad_writable: bool, backup):
    """What a kernel without fused passes does first: back up the states, then give fp32
    gradients scaled by ``scale`` (see CPUAdamKernel.update)."""
    for dst, src in zip(backup, (master, exp_avg, exp_avg_sq)):
        dst.copy_(src)
    widened = grad.dtype != torch.float32
    g = grad.float() if widened else grad
    if scale is None:
        return g
    scale = scale.to(g.device)
    return g.mul_(scale) if widened or grad_writable else g * scale

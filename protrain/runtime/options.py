"""What a runtime is told besides its plan: the framework's optimizer settings in the runtime's
terms (``OptimizerSetup``) and how the adapter wants the plan run (``RuntimeOptions``).

The plan decides the memory knobs; these say what the plan cannot know (the optimizer the user
configured, the accumulation boundary, where the SSD tier lives, the data-parallel group).
Adapters build both; the runtime only reads them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager

from .adam import AdamHyper
from .collectives import DataParallel
from .compile import CompileRequest


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSetup:
    """What the framework's optimizer configuration says, in the runtime's terms."""

    param_groups: list[dict]
    """The framework optimizer's param groups (shared: a scheduler's lr changes are seen)."""
    hyper: Callable[[dict], AdamHyper]
    """Adam hyper-parameters of a group, read at every step."""
    adamw: bool
    """Decoupled weight decay (AdamW) rather than L2 added to the gradient (Adam)."""
    torch_adam: bool = False
    """Use torch's Adam implementation everywhere (DeepSpeed's ``"torch_adam": true``, or a
    client torch.optim.Adam/AdamW, which plain DeepSpeed steps itself)."""
    torch_fused: bool | None = None
    """With ``torch_adam``: torch's fused implementation (a client optimizer's ``fused``);
    None: torch's default for the tensors' device."""
    torch_foreach: bool | None = None
    """With ``torch_adam``: torch's for-each implementation (a client optimizer's
    ``foreach``); None: torch's default for the tensors' device."""
    grad_accumulation_steps: int = 1
    """Micro-batches whose gradients are added up before each optimizer step."""
    clip: float = 0.0
    """Global gradient-norm clipping threshold (0: no clipping)."""
    loss_scaler: object | None = None
    """DeepSpeed's loss scaler for fp16, else None."""
    cpu_adam: str = "auto"
    """Host Adam kernel: "native" (csrc, GIL-free), "deepspeed", or "auto" (native on a GPU
    machine, DeepSpeed's on a CPU "device", where updates run inline)."""
    host_thread: bool | None = None
    """Run CPU Adam on a worker thread (None: when a GPU computes meanwhile; True also on a CPU
    "device", e.g. to measure the overlap on CPU with torch and the kernel on a core each)."""
    cpu_adam_threads: int = 0
    """OpenMP threads of the host Adam kernel: the rank's share of the node's cores
    (``runtime.node.NodeShare.threads``, or the user's ``cpu_adam_threads``); 0: the calling
    thread's count (OMP_NUM_THREADS, else every core)."""
    speculate_chunks: int | None = None
    """How many offloaded chunks (the last in execution order) update speculatively during
    backward when clipping or fp16 loss scaling is on; None: all of them, 0: none (CPU Adam
    of every offloaded chunk then waits for the end of backward)."""


def _every_micro_batch() -> bool:
    return True


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeOptions:
    """How the adapter wants a plan run: hooks into the framework, the data-parallel group,
    storage paths, diagnostics. Nothing here changes what is computed."""

    is_boundary: Callable[[], bool] = _every_micro_batch
    """Asked at each backward: whether this micro-batch ends an optimizer step (the gradient
    accumulation boundary), when offloaded chunks' updates may start."""
    accounting: bool = False
    """Count device bytes by the runtime's own accounting (CPU tests, where no device
    allocator can be asked): ``ProTrainRuntime.device_peak``."""
    dp: DataParallel | None = None
    """The data-parallel group offloaded chunks are sharded over (None: one rank)."""
    ssd_root: str | None = None
    """Directory of the SSD tier's activation files (blocks in BlockMode.SSD)."""
    ssd_verify: bool | str = "auto"
    """Check what is read back from the drive against checksums taken when written: "auto"
    the optimizer states on NVMe (kept across steps and exported by checkpoints), true also
    the SSD tier's activations (read once, within the step), false nothing."""
    ssd_min_bytes: int = 2**20
    """Saved tensors smaller than this stay in host memory instead of going to the SSD."""
    trace_file: str | None = None
    """Write each iteration's timeline (parts, copies, CPU Adam per chunk) there."""
    compile: CompileRequest | None = None
    """torch.compile as the user asked for it, applied to each block's forward (None: eager)."""
    gather_timeout_s: float | None = None
    """Seconds a rank waits for the others before gathering sharded weights for a state_dict
    (None: the process group's timeout)."""
    save_fix: str = ""
    """The way out to print when a state_dict of sharded weights is called on some ranks only."""
    outside_forward: Callable[[], ContextManager] | None = None
    """A context the adapter wraps around a forward of the model that does not come through
    its engine call (``model.generate``, ``module(x)``; runtime/outside.py), e.g. to run plain
    attention where its forward splits sequences over ranks. None: nothing."""

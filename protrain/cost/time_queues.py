"""What the step-time model's phases share: ``StepCosts``, what each piece of work costs and how
the queues are wired (fixed for one simulation), and ``QueueState``, the four queues' clocks and
busy times that forward, backward and the step's end advance in turn (``cost.time_model``).

Every time is an array over the K plans simulated at once; per-chunk and per-part records are
[chunks, K] / [parts, K], so a phase reads and writes one chunk of every plan as one row."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..block_mode import CKPT_SSD, INPUT_MOVED, SSD
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from .chunk_times import (allreduce_times, backup_times, check_times, chunk_transfer_times, device_adam_elements,
                          gather_times, state_io_times)
from .host_share import RankRates, rank_rates
from ..layout import ChunkLayout
from .memory import ckpt_input_bytes, offload_bytes, part_modes
from ..state_tier import STAGING_SLOTS


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Seconds each piece of work takes and the switches that place it; arrays are per chunk
    ([chunks]), per part ([parts]) or per plan ([K])."""

    profile: ModelProfile
    layout: ChunkLayout
    hw: HardwareProfile
    rr: RankRates
    """The copy and "device" Adam rates of one rank (``cost.host_share``)."""
    world: int
    modes: np.ndarray
    """[parts, K] block mode codes of every part (pre and post NONE)."""
    npers: np.ndarray
    """[K] persistent chunks: chunks below stay on the device, the others are offloaded."""
    nrep: np.ndarray
    """[K] replicated persistent chunks: chunks from here up to ``npers`` are sharded
    persistent (gathered into buffers over the collectives, updated by device Adam); the
    chunks from here on stream through the buffers."""
    nbuf: np.ndarray
    """[K] device buffers the offloaded chunks cycle through."""
    nnvme: np.ndarray
    """[K] chunks whose optimizer states are on the drive (the last ones)."""
    drive_rows: np.ndarray
    """[chunks, K] whether chunk c's states are on the drive (``on_drive``)."""
    t_up: np.ndarray
    t_down: np.ndarray
    t_adam: np.ndarray
    """[chunks] upload, gradient offload and CPU Adam times (``chunk_transfer_times``)."""
    t_sread: np.ndarray
    t_swrite: np.ndarray
    """[chunks] an NVMe chunk's states read from the drive and written back
    (``chunk_times.state_io_times``)."""
    t_check: np.ndarray
    """[chunks] verdict check of an offloaded chunk's gradients (clipping / fp16 only)."""
    t_allreduce: np.ndarray
    """[chunks] a persistent chunk's gradient all-reduce over the ranks (zeros on one rank)."""
    t_host_check: np.ndarray
    """``t_check`` where the checks run on the host's CPU queue, else zeros."""
    t_gather: np.ndarray
    """[chunks] a sharded chunk's all-gather (its upload) and reduce-scatter (its gradient
    offload), ``chunk_times.gather_times``."""
    adam_elements: np.ndarray
    """[K] elements device Adam updates at the step (``chunk_times.device_adam_elements``)."""
    spec_from: np.ndarray | None
    """[K] first chunk that updates speculatively during backward, None without speculation."""
    t_backup: np.ndarray | None
    t_spec: np.ndarray | None
    """[chunks] a speculating chunk's backup, and its whole turn on the CPU queue (check,
    backup, update); None without speculation."""
    saved: np.ndarray
    """[parts, K] bytes a SWAP / SSD part copies off the device, a CKPT_HOST / CKPT_SSD part its
    input."""
    w_time: np.ndarray
    r_time: np.ndarray
    """[parts, K] NVMe write / read of those bytes (SSD and CKPT_SSD parts)."""
    serial: bool
    """No copy engine (a CPU "device"): every copy runs on the compute timeline."""
    inline: bool
    """CPU Adam on the compute timeline too (serial, without a thread of its own)."""
    shared: bool
    """One copy engine: the H2D and D2H queues are one FIFO."""
    gds: bool
    """GPUDirect Storage: NVMe writes and reads have queues of their own."""
    optimizer_step: bool
    cpu_overlap: bool
    checks_on_host: bool
    speculation_wrong: bool
    carry_over: bool
    """As ``simulate``'s arguments of the same names."""
    any_nvme: bool = False
    """Some plan keeps states on the drive (else the CPU queue's simpler paths serve)."""
    any_shard: bool = False
    """Some plan has sharded persistent chunks (else chunk times are the same in every plan)."""
    row_index: np.ndarray | None = None
    """[K] 0..K-1 (``rows``)."""
    rep_range: tuple[int, int] = (0, 0)
    host_range: tuple[int, int] = (0, 0)
    """The least and most of ``nrep`` / ``npers`` over the plans: a chunk at or above the
    most streams (``streamed``) / has its states on the host in every plan, one below the
    least in none (``streams_in``, ``host_in``) - the common case, a search batch's points
    mostly share n_persist, where a per-plan select is not needed."""

    buf_range: tuple[int, int] = (0, 0)
    """The least and most of ``nbuf`` over the plans (``refetched_in``, ``reuses_in``)."""

    @property
    def k_plans(self) -> int:
        return self.modes.shape[1]

    def reuses_in(self, j: int) -> bool | None:
        """``streams_in`` for the forward upload of chunk j reusing the buffer of chunk
        j - n_buffer, itself streamed (``_upload``'s wait)."""
        if j - self.buf_range[1] >= self.rep_range[1]:
            return True
        return False if j - self.buf_range[0] < self.rep_range[0] else None

    def refetched_in(self, j: int) -> bool | None:
        """``streams_in`` for chunk j's upload in backward: it streams and no buffer holds it
        still from forward (j below n_chunks - n_buffer)."""
        n = self.layout.n_chunks
        u = self.streams_in(j)
        if u is True and j < n - self.buf_range[1]:
            return True
        return False if u is False or j >= n - self.buf_range[0] else None

    def at_chunk(self, times: np.ndarray, chunk) -> np.ndarray:
        """``times[chunk, plan]`` for each plan: ``chunk`` [K], ``times`` [chunks, K]."""
        return times.ravel().take(chunk * self.k_plans + self.rows)

    @property
    def rows(self) -> np.ndarray:
        return self.row_index if self.row_index is not None else np.arange(self.k_plans)

    def streams_in(self, c: int) -> bool | None:
        """True: chunk c streams (``streamed``) in every plan; False: in none; None: in some."""
        return True if c >= self.rep_range[1] else False if c < self.rep_range[0] else None

    def host_in(self, c: int) -> bool | None:
        """``streams_in`` for chunk c's states on the host (c >= ``npers``)."""
        return True if c >= self.host_range[1] else False if c < self.host_range[0] else None

    def on_drive(self, c: int) -> np.ndarray:
        """[K] whether chunk c's states are on the drive."""
        return self.drive_rows[c]

    def chunk_bytes(self, c: int):
        """Bytes this rank copies to upload or offload chunk c (its shard)."""
        return self.layout.used[c] * self.profile.param_bytes / self.world

    def streamed(self, c: int) -> np.ndarray:
        """[K] whether chunk c streams through the buffers (offloaded or sharded)."""
        return c >= self.nrep

    def up_time(self, c: int):
        """Seconds of chunk c's upload on the upload queue: its shard's H2D copy and the
        all-gather where it is offloaded, the all-gather alone where it is sharded ([K], or
        one figure where no plan shards)."""
        if not self.any_shard:
            return self.t_up[c]
        return np.where(c >= self.npers, self.t_up[c], self.t_gather[c])

    def down_time(self, c: int):
        """``up_time`` for chunk c's gradients: the reduce-scatter, then the D2H copy where
        it is offloaded."""
        if not self.any_shard:
            return self.t_down[c]
        return np.where(c >= self.npers, self.t_down[c], self.t_gather[c])


def step_costs(profile: ModelProfile, layout: ChunkLayout, hw: HardwareProfile, n_persist, n_buffer,
               block_modes, *, optimizer_step: bool, cpu_overlap: bool, world: int, speculate_from,
               speculation_wrong: bool, carry_over: bool, checks_on_host: bool, n_nvme=0,
               n_shard=0) -> StepCosts:
    """The costs of ``simulate``'s arguments; ValueError for plans it cannot simulate."""
    modes = np.ascontiguousarray(part_modes(profile, block_modes).T)
    k_plans = modes.shape[1]
    npers = np.broadcast_to(np.asarray(n_persist, dtype=np.int64), (k_plans,))
    nbuf = np.broadcast_to(np.asarray(n_buffer, dtype=np.int64), (k_plans,))
    nnvme = np.broadcast_to(np.asarray(n_nvme, dtype=np.int64), (k_plans,))
    nshard = np.broadcast_to(np.asarray(n_shard, dtype=np.int64), (k_plans,))
    n_chunks = layout.n_chunks
    if ((nshard < 0) | (nshard > npers)).any():
        raise ValueError("n_shard counts persistent chunks: from 0 to n_persist")
    t_up, t_down, t_adam = chunk_transfer_times(layout, profile, hw, world)
    t_sread, t_swrite = state_io_times(layout, hw, world, profile.param_bytes < 4,
                                       speculative=speculate_from is not None and not cpu_overlap)
    rr = rank_rates(hw)
    if (nnvme > n_chunks - npers).any() or (nnvme < 0).any():
        raise ValueError("n_nvme counts offloaded chunks: from 0 to n_chunks - n_persist")
    if (nnvme > 0).any() and (rr.nvme_read <= 0 or rr.nvme_write <= 0):
        raise ValueError("plans with states on NVMe need the NVMe bandwidths of the SSD path")
    # Clipping / fp16 (no overlap): each offloaded chunk's gradients are checked (norms,
    # overflow), on the host as they land (before or in its speculative update), or on the
    # device before they leave.
    t_check = check_times(layout, hw, world) if not cpu_overlap and optimizer_step else np.zeros(n_chunks)
    t_host_check = t_check if checks_on_host else np.zeros(n_chunks)
    spec_from = t_backup = t_spec = None
    if speculate_from is not None and not cpu_overlap:
        spec_from = np.broadcast_to(np.asarray(speculate_from, dtype=np.int64), (k_plans,))
        t_backup = backup_times(layout, hw, t_adam, world)
        t_spec = t_host_check + t_adam + t_backup
    saved, w_time, r_time = activation_copy_times(profile, hw, modes)
    if ((nbuf < 1) & (npers - nshard < n_chunks)).any():
        raise ValueError("a plan with non-persistent chunks needs at least one buffer")
    if ((modes == SSD) | (modes == CKPT_SSD)).any() and (hw.nvme_write_bandwidth <= 0 or hw.nvme_read_bandwidth <= 0):
        raise ValueError("plans with SSD blocks need the NVMe bandwidths of the SSD path")
    serial = hw.copy_engines <= 0
    gds = hw.nvme_gds
    return StepCosts(
        profile=profile, layout=layout, hw=hw, rr=rr, world=world, modes=modes, npers=npers, nrep=npers - nshard,
        nbuf=nbuf, nnvme=nnvme, drive_rows=np.arange(n_chunks)[:, None] >= (n_chunks - nnvme)[None, :],
        t_up=t_up, t_down=t_down, t_adam=t_adam, t_sread=t_sread,
        t_swrite=t_swrite, t_check=t_check, t_allreduce=allreduce_times(layout, hw, world),
        t_host_check=t_host_check, t_gather=gather_times(layout, profile, hw, world),
        adam_elements=device_adam_elements(layout, npers, nshard, world), spec_from=spec_from, t_backup=t_backup, t_spec=t_spec,
        saved=saved, w_time=w_time, r_time=r_time, serial=serial,
        inline=serial and not hw.cpu_adam_thread, shared=hw.copy_engines == 1, gds=gds,
        optimizer_step=optimizer_step, cpu_overlap=cpu_overlap, checks_on_host=checks_on_host,
        speculation_wrong=speculation_wrong, carry_over=carry_over, any_nvme=bool((nnvme > 0).any()),
        any_shard=bool((nshard > 0).any()), row_index=np.arange(k_plans),
        rep_range=_least_most(npers - nshard), host_range=_least_most(npers), buf_range=_least_most(nbuf))


def _least_most(x: np.ndarray) -> tuple[int, int]:
    return (int(x.min()), int(x.max())) if len(x) else (0, 0)


def select(uniform: bool | None, mask, a, b):
    """``np.where(mask, a, b)``, where ``uniform`` (``StepCosts.streams_in`` / ``host_in``)
    says that ``mask`` is True (False) for every plan: then ``a`` (``b``) as it is, no select.
    The values are the same; the simulation's loops over chunks call this a few times a
    chunk, and a select over thousands of plans is most of such a call's cost."""
    if uniform is None:
        return np.where(mask, a, b)
    return a if uniform else b


@dataclass(slots=True)
class QueueState:
    """When each queue is next free, what it has done so far, and the per-chunk times a later
    phase needs; arrays over the K plans. The phases replace the clocks as they issue work."""

    comp: np.ndarray
    """Device compute."""
    h2d: np.ndarray
    d2h: np.ndarray
    """The host-to-device and device-to-host copy engines."""
    ssd_w: np.ndarray
    ssd_r: np.ndarray
    """The NVMe write and read queues of the activations (SSD blocks; in compatibility mode
    they hold the copy queues too)."""
    drive_busy: np.ndarray
    """[2, K] seconds of reads ([0]) and writes ([1]) issued to the drive, activations and
    optimizer states: each direction is a floor under a step with states on the drive
    (``cost.time_state_io``)."""
    cpu: np.ndarray
    """The CPU optimizer (CPU Adam, speculation backups, the host's verdict checks)."""
    net: np.ndarray
    """The collectives' queue: the persistent chunks' gradient all-reduces at the boundary."""
    shard_down: np.ndarray
    """The last sharded chunk's gradients in its shard at (device Adam waits for them)."""
    cpu_busy: np.ndarray
    """CPU Adam and backup time issued so far."""
    check_busy: np.ndarray
    """The host's verdict checks, issued in backward (joins ``cpu_busy`` at its end)."""
    h2d_bytes: np.ndarray
    d2h_bytes: np.ndarray
    up_start: np.ndarray
    """[chunks, K] forward upload of each chunk starts at (where a late CPU Adam would stall
    the next step's forward)."""
    done_at: np.ndarray
    """[chunks, K] CPU Adam of each offloaded chunk ends at."""
    spec_ready: np.ndarray | None
    """[chunks, K] backup of a speculating chunk done at (inf where it does not speculate)."""
    deferred: list[tuple[int, np.ndarray, np.ndarray, np.ndarray | float]]
    """Updates left for after backward: (chunk, which plans, grads on host at, extra time: the
    restore before a redo)."""
    pending: np.ndarray
    """[chunks + 1, K] the exact updates whose gradients are on the host and which the CPU has
    not taken yet, as a stack per plan (``n_pending`` deep): pushed as gradients land, in
    descending chunk index, so its top is the lowest pending chunk - the one the runtime's
    worker takes next (``time_backward``, forward order)."""
    n_pending: np.ndarray
    """[K] depth of ``pending``."""
    grads_at: np.ndarray
    """[chunks, K] when each offloaded chunk's gradients were on the host."""
    extra: np.ndarray
    """[chunks, K] seconds on the CPU queue before a pending chunk's update (the restore
    before a redo)."""
    nvq: np.ndarray
    """[chunks + 1, K] the pending updates of chunks on the drive, a FIFO per plan from
    ``nv_head`` to ``nv_tail``: the order their reads were wanted in (``cost.time_state_io``)."""
    nv_head: np.ndarray
    nv_tail: np.ndarray
    want_at: np.ndarray
    """[chunks, K] when a chunk on the drive had its states' read wanted."""
    taken: np.ndarray
    """[2, K] updates the CPU took from the pending ones: of chunks on the drive, in host memory."""
    totals: np.ndarray
    """[2, K] the pending updates of a step in all, on the drive and in host memory
    (``time_state_io.nvme_turn`` interleaves them in proportion)."""
    drive_q: np.ndarray
    """[2, K] the drive's queue for the states (reads; [1] the write-backs where the two
    directions are independent) free at."""
    slots: np.ndarray
    """[STAGING_SLOTS, K] when the staging buffers of the last uses of states are free, the
    oldest first (inf: its write-back not issued yet)."""
    w_iss: np.ndarray
    w_len: np.ndarray
    """[K] the last write-back of states: issued at and seconds (on a shared drive it is
    served with the next read, in issue order), or with independent directions its end."""
    trace: list | None
    """(lane, what, label, start, end) of every piece of work of the first plan, or None."""

    @classmethod
    def idle(cls, costs: StepCosts, trace: list | None) -> QueueState:
        n_chunks, k_plans = costs.layout.n_chunks, costs.k_plans
        zeros = np.zeros(k_plans)
        return cls(comp=zeros.copy(), h2d=zeros.copy(), d2h=zeros.copy(), ssd_w=zeros.copy(),
                   ssd_r=zeros.copy(), drive_busy=np.zeros((2, k_plans)), cpu=zeros.copy(), net=zeros.copy(),
                   shard_down=zeros.copy(),
                   cpu_busy=zeros.copy(),
                   check_busy=np.zeros(k_plans), h2d_bytes=zeros.copy(), d2h_bytes=zeros.copy(),
                   up_start=np.zeros((n_chunks, k_plans)), done_at=np.zeros((n_chunks, k_plans)),
                   spec_ready=(np.full((n_chunks, k_plans), np.inf)
                               if costs.spec_from is not None else None),
                   deferred=[], pending=np.zeros((n_chunks + 1, k_plans), dtype=np.int64),
                   n_pending=np.zeros(k_plans, dtype=np.int64),
                   grads_at=np.zeros((n_chunks, k_plans)), extra=np.zeros((n_chunks, k_plans)),
                   nvq=np.zeros((n_chunks + 1, k_plans), dtype=np.int64),
                   nv_head=np.zeros(k_plans, dtype=np.int64), nv_tail=np.zeros(k_plans, dtype=np.int64),
                   want_at=np.zeros((n_chunks, k_plans)), taken=np.zeros((2, k_plans)),
                   totals=np.stack([costs.nnvme, n_chunks - costs.npers - costs.nnvme]).astype(np.float64),
                   drive_q=np.zeros((2, k_plans)), slots=np.zeros((STAGING_SLOTS, k_plans)),
                   w_iss=np.full(k_plans, -np.inf), w_len=np.zeros(k_plans), trace=trace)

    def record(self, lane: str, what: str, label: str, start, end, mask=True) -> None:
        """Trace one piece of work of the first plan, where that plan runs it (``mask``)."""
        if self.trace is not None and bool(np.asarray(mask).reshape(-1)[0]):
            a, b = float(np.asarray(start).reshape(-1)[0]), float(np.asarray(end).reshape(-1)[0])
            if b > a:
                self.trace.append((lane, what, label, a, b))

    def join_copy_queues(self) -> None:
        """One copy engine: a copy in either direction waits for every copy issued before it."""
        self.d2h = self.h2d = np.maximum(self.h2d, self.d2h)


def activation_copy_times(profile: ModelProfile, hw: HardwareProfile, modes: np.ndarray):
    """(bytes each part copies off the device and back, its NVMe write and read seconds), each
    [parts, K] for per-part mode codes ``modes`` [parts, K]: a CKPT_HOST / CKPT_SSD part copies
    its input, other parts what they saved (only SWAP / SSD parts copy them: the callers mask)."""
    rr = rank_rates(hw)
    saved = np.array([offload_bytes(p) for p in profile.parts], dtype=np.float64)
    inputs = np.array([ckpt_input_bytes(p) for p in profile.parts], dtype=np.float64)
    saved = np.where(np.isin(modes, INPUT_MOVED), inputs[:, None], saved[:, None])
    # Without GDS an NVMe copy bounces through the host: no faster than the PCIe copy.
    gds = hw.nvme_gds
    w_time = (saved / min(rr.nvme_write, np.inf if gds else rr.d2h)
              if rr.nvme_write > 0 else saved * 0)
    r_time = (saved / min(rr.nvme_read, np.inf if gds else rr.h2d)
              if rr.nvme_read > 0 else saved * 0)
    return saved, w_time, r_time

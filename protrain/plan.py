"""Plan: the knobs the search chose, the per-block modes they imply, and what the cost models
predict for them. A frozen value: printed at start-up, saved to JSON, loaded back, overridden.
The runtime executes a Plan and never re-derives a decision the Plan made."""
from __future__ import annotations

from dataclasses import dataclass, field

from .block_mode import BlockMode, layout_block_modes, modes_string, same_counts
from .profile.model_profile import ParamRecord
from .serde import JsonValue
from .state_tier import nvme_chunk_ids
from .timeline import Timeline
from .units import fmt_bytes, fmt_seconds


def host_budget_text(share: int, node: int | None, ranks_per_node: int) -> str:
    """A rank's host budget in words: ``4.0 GiB per rank (the node's 32.0 GiB / 8 ranks)``;
    the bytes alone with one rank per node, or where the node's figure is unknown (None)."""
    if ranks_per_node <= 1 or node is None:
        return fmt_bytes(share)
    return f"{fmt_bytes(share)} per rank (the node's {fmt_bytes(node)} / {ranks_per_node} ranks)"


@dataclass(frozen=True, slots=True)
class Knobs:
    """ProTrain's knobs, with SSDTrain's NVMe tier and AutoSP's two (sequence parallelism and
    selective checkpointing)."""

    chunk_size: int
    """Chunk capacity in bytes."""
    n_persist: int
    """Leading chunks that stay on the device (parameters, gradients, optimizer states)."""
    n_buffer: int
    """Device buffers the other chunks stream through."""
    n_swap: int
    """Blocks whose saved activations are swapped to host memory (the first ones)."""
    n_checkpoint: int
    """Blocks recomputed in backward (interleaved over the non-swapped blocks)."""
    n_ssd: int = 0
    """Blocks whose saved activations go to NVMe (the very first ones)."""
    n_selective: int = 0
    """Blocks under long-context selective checkpointing: attention outputs kept, the rest
    recomputed in backward (placed with the checkpointed blocks, after them)."""
    sequence_parallel: int = 1
    """Ulysses sequence-parallel degree P: each sequence is split over P ranks, which hold 1/P
    of its tokens outside attention and 1/P of the heads inside it. The predictions are per
    rank; the runtime runs the P micro-batches of its group one after another."""

    n_nvme: int = 0
    """Of the offloaded chunks, how many keep their optimizer states (the fp32 master where it
    is separate from the parameters, exp_avg, exp_avg_sq) on NVMe under ``ssd_path``: the last
    ones (``protrain.state_tier.nvme_chunk_ids``). Their parameters and gradients stay in host
    memory; CPU Adam streams their states through a ring of pinned staging buffers."""

    n_shard: int = 0
    """Of the ``n_persist`` chunks on the device, how many (the last ones) are *sharded*
    persistent (protrain.runtime.chunks): each of the ``world`` data-parallel ranks keeps 1/world
    of their parameters, gradients and optimizer states on its device, gathers a chunk into one
    of the ``n_buffer`` buffers ahead of use (a device copy and an all-gather) and
    reduce-scatters its gradients after backward; device Adam updates the shard. Several ranks
    then keep more of the model on their devices than one (ZeRO-3 on the device)."""

    head_tile: int = 0
    """Tokens per tile of the head and loss (protrain.runtime.tiled_head: logits and
    cross-entropy a tile at a time, recomputed per tile in backward); 0: the model's own head,
    whole logits. Chosen around the inner search, as P is (protrain.search.head)."""

    mlp_tile: int = 0
    """Tokens per tile of every block's MLP (protrain.runtime.tiled_mlp: the MLP a tile at a
    time, recomputed per tile in backward, only its input saved); 0: the model's own MLPs.
    Chosen around the inner search (protrain.search.mlp)."""

    ckpt_input: str = "device"
    """Where the ``n_checkpoint`` blocks keep their inputs until their backward: ``"device"``,
    ``"host"`` (BlockMode.CKPT_HOST: pinned host memory, fetched back one block ahead) or
    ``"drive"`` (BlockMode.CKPT_SSD: the NVMe path, read back one block ahead).
    Chosen around the inner search (protrain.search.ckpt_input)."""

    def as_tuple(self) -> tuple[int, ...]:
        """The knobs the inner search chooses, in its tie-break order (P and the head's tile
        are chosen outside)."""
        return (self.chunk_size, self.n_persist, self.n_buffer, self.n_swap, self.n_checkpoint,
                self.n_ssd, self.n_selective)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the cost models predict for a plan (seconds, bytes)."""

    iter_time: float
    """One training iteration (forward, backward, optimizer) of one micro-batch: the micro-step
    at the gradient accumulation boundary."""
    step_time: float
    """One optimizer step: iter_time plus (grad_accumulation_steps - 1) micro_step_time. This is
    what the search minimises."""
    micro_step_time: float
    """A micro-step that only accumulates gradients (equals iter_time without accumulation)."""
    grad_accumulation_steps: int
    fwd_time: float
    bwd_time: float
    gpu_optim_time: float
    cpu_optim_time: float
    """CPU Adam busy time (overlaps backward)."""
    cpu_optim_exposed: float
    """CPU Adam time not hidden behind the device's work."""
    peak_device_bytes: int
    """Predicted peak of allocated device memory (compare with torch.cuda.max_memory_allocated)."""
    model_state_bytes: int
    """Persistent chunks + chunk buffers."""
    activation_peak_bytes: int
    peak_at: str
    """Where in the iteration the peak happens."""
    host_bytes: int
    """Pinned host memory: offloaded chunk states (the optimizer states of chunks on the drive
    left out, their staging ring counted) + swapped activations + speculation backups."""
    swap_host_bytes: int
    h2d_bytes: int
    """Bytes copied host to device per iteration (chunk uploads, swap prefetch)."""
    d2h_bytes: int
    """Bytes copied device to host per iteration (gradients, swap-outs)."""
    ssd_bytes: int = 0
    """Bytes written to (and read back from) NVMe per iteration; also the disk space needed."""
    iter_time_unspeculated: float = 0.0
    """With speculating chunks (``Plan.n_speculate``): the iteration when nothing speculates -
    the runtime's rule after a step that clipped or overflowed (0: an older plan file)."""
    cpu_optim_exposed_unspeculated: float = 0.0
    """With speculating chunks: ``cpu_optim_exposed`` when nothing speculates (0: an older plan
    file, or no chunk speculates - then ``cpu_optim_exposed`` is it)."""
    iter_time_rolled_back: float = 0.0
    """With speculating chunks: the iteration whose speculation was wrong (the step clips):
    the speculated chunks restored from their backups and updated again after backward."""
    norm_scratch_bytes: int = 0
    """Of the peak: the fp32 copy of one 16-bit gradient a clipping norm takes on the device
    (protrain.cost.memory.norm_scratch_bytes)."""
    nvme_state_bytes: int = 0
    """Drive space the optimizer states of the ``n_nvme`` chunks take under ``ssd_path``, per
    rank (``state_tier.NVME_STATE_SLOTS`` copies: the committed states and a speculative
    update's other slot); 0 without states on the drive."""
    nvme_state_io_bytes: int = 0
    """Bytes of optimizer states read from the drive and written back per optimizer step, per
    rank (each NVMe chunk's states once each way)."""
    staging_bytes: int = 0
    """Of ``host_bytes``: the pinned staging ring (``state_tier.STAGING_SLOTS`` buffers of one
    chunk's states) the NVMe chunks' states stream through."""

    def expected_iter_time(self, clip_fraction: float) -> float:
        """The mean iteration when a fraction of the steps clip (or overflow), independently,
        under the runtime's rule: a step speculates unless the one before clipped; right, it
        takes ``iter_time``; wrong, ``iter_time_rolled_back``; unspeculated,
        ``iter_time_unspeculated``."""
        if not 0.0 <= clip_fraction <= 1.0:
            raise ValueError(f"clip_fraction={clip_fraction}: a fraction of steps, from 0 to 1")
        if not self.iter_time_unspeculated:
            return self.iter_time
        f = clip_fraction
        return ((1 - f) * ((1 - f) * self.iter_time + f * self.iter_time_rolled_back)
                + f * self.iter_time_unspeculated)


@dataclass(frozen=True, slots=True)
class ChunkSummary:
    n_chunks: int
    chunk_numel: int
    total_numel: int
    min_persist: int
    """Chunks that must persist (tied parameters)."""


@dataclass(frozen=True, slots=True)
class Alternative:
    """A runner-up plan, for the explain table."""

    knobs: Knobs
    iter_time: float
    peak_device_bytes: int
    host_bytes: int


@dataclass(frozen=True, slots=True)
class Plan(JsonValue):
    knobs: Knobs
    block_modes: tuple[BlockMode, ...]
    chunks: ChunkSummary
    prediction: Prediction
    model: str
    """What was planned for (ModelProfile.describe())."""
    machine: str
    """The hardware profile it was planned for (HardwareProfile.describe())."""
    device_memory: int
    """Device budget the plan was checked against."""
    host_memory: int
    """Host budget the plan was checked against: this rank's share of the node's host memory
    (``node_host_memory`` // ``ranks_per_node``), as ``device_memory`` is this rank's device."""
    memory_margin: float
    param_bytes: int
    profile_source: str
    """``measured`` or ``analytic``."""
    pinned: tuple[str, ...] = ()
    """Knobs the user fixed."""
    alternatives: tuple[Alternative, ...] = ()
    search_seconds: float = 0.0
    fastest_step: float = 0.0
    """The fastest step time the search found among the plans it compared (the hedge may pick
    a slower one that moves fewer bytes: ``notes`` says so); outer loops (tiles, where the
    checkpointed inputs go) compare their variants by it. 0 where not recorded (plans made
    by ``evaluate`` alone, older files): ``fastest()`` is the plan's own step then."""
    candidates_evaluated: int = 0
    """Simulations the search ran."""
    candidates_total: int = 0
    """The points the search considered: those it fitted that fit the budgets, and those in
    blocks its bounds ruled out before fitting them (``search.pairs``: their fit unchecked)."""
    notes: tuple[str, ...] = field(default=())
    params: tuple[ParamRecord, ...] = ()
    """The parameters in execution order (from the profile): with them a saved plan rebuilds
    its chunk layout without profiling again."""
    block_saved_bytes: tuple[int, ...] = ()
    """Bytes each block copies off the device when offloaded: what it saves for backward,
    including storages an earlier block saved first (sizes the host arenas of swapped blocks)."""
    block_input_bytes: tuple[int, ...] = ()
    """Bytes of each block's input (sizes the host arenas of the CKPT_HOST blocks' inputs)."""
    mlp_with_norm: bool = False
    """With ``knobs.mlp_tile``: each MLP's pre-norm runs inside its tiles (the profile found it
    can: ``MLPProfile.with_norm``), as the figures were measured."""
    n_speculate: int = 0
    """Offloaded chunks (the last in execution order) whose CPU Adam update runs speculatively
    during backward under gradient clipping / fp16 loss scaling (PlannerConfig
    ``cpu_optim_speculative``); 0 without those, where every update overlaps exactly."""
    timeline: Timeline | None = None
    """The predicted iteration, event by event (``protrain explain PLAN.json --plot out.png``
    draws it); None in plan files written before it existed."""
    micro_batch: int | None = None
    """Samples per micro-batch the plan was made for (None: unknown, e.g. an older plan file)."""
    seq_len: int | None = None
    """Sequence length the plan was made for (None: unknown)."""
    blocks: tuple[str, ...] | None = None
    """The blocks' qualified names in the model, in the order they run (one per block mode),
    as the plan was made for them: the DeepSpeed engine runs the plan on these modules. Fewer
    or none where the model's own list runs a block twice in a forward (ProTrain then plans
    coarser blocks). None: not recorded (plans made elsewhere, older files): the blocks the
    model's list gives."""
    world: int = 1
    """Data-parallel ranks the plan was made for: offloaded and sharded chunks keep 1/world of
    their states on each rank. 1 in plan files written before it was recorded."""
    ranks_per_node: int = 1
    """Ranks sharing the host the plan was made for (``HardwareProfile.ranks_per_node``): its
    CPU Adam and host passes are priced at 1/ranks_per_node of the node's rates. 1 in plan
    files written before it was recorded."""
    node_host_memory: int | None = None
    """The node's host memory ``host_memory`` is a share of (``HardwareProfile.host_memory``:
    ``protrain plan --host-memory``, ``protrain.host_memory``). None in plan files written
    before it was recorded: their ``host_memory`` is still what they were checked against."""

    def differs_from(self, *, n_blocks: int, param_bytes: int, micro_batch: int | None,
                     seq_len: int | None) -> str | None:
        """What about a run makes this plan's predictions wrong for it (activations scale with
        the batch shape, model states with the parameter width), or None when nothing does."""
        if len(self.block_modes) != n_blocks:
            return f"it was made for a model with {len(self.block_modes)} blocks, this one has {n_blocks}"
        if self.param_bytes != param_bytes:
            return (f"it was made for {self.param_bytes}-byte parameters, this run trains "
                    f"{param_bytes}-byte ones (another dtype: bf16/fp16 vs fp32)")
        if None not in (self.micro_batch, micro_batch) and self.micro_batch != micro_batch:
            return f"it was made for micro-batch {self.micro_batch}, this run's batches have {micro_batch}"
        if None not in (self.seq_len, seq_len) and self.seq_len != seq_len:
            return f"it was made for sequence length {self.seq_len}, this run's batches have {seq_len}"
        return None

    def fastest(self) -> float:
        """The fastest step the search found for this plan's variant (``fastest_step``), or the
        plan's own where not recorded."""
        return self.fastest_step or self.prediction.step_time

    def layout(self):
        """The chunk layout this plan runs with."""
        from .layout import layout_of
        return layout_of(self.params, len(self.block_modes) + 2, self.param_bytes,
                         self.knobs.chunk_size // self.param_bytes)

    def __post_init__(self) -> None:
        k = self.knobs
        n = len(self.block_modes)
        # Usually ProTrain's layout rule; a framework adapter may re-arrange the same counts
        # (Megatron's native recompute checkpoints the first blocks).
        if not same_counts(self.block_modes, layout_block_modes(n, k.n_swap, k.n_checkpoint, k.n_ssd,
                                                                k.n_selective, k.ckpt_input)):
            raise ValueError(f"Plan.block_modes {modes_string(self.block_modes)} do not hold "
                             f"n_ssd={k.n_ssd}, n_swap={k.n_swap}, n_checkpoint={k.n_checkpoint}, "
                             f"n_selective={k.n_selective} blocks")
        nvme_chunk_ids(self.chunks.n_chunks, k.n_persist, k.n_nvme)   # raises if out of range
        if not 0 <= k.n_shard <= k.n_persist:
            raise ValueError(f"n_shard={k.n_shard}: the sharded persistent chunks are some of the "
                             f"n_persist={k.n_persist}; use 0 to {k.n_persist}")
        if k.n_shard and k.n_buffer < 1:
            raise ValueError(f"n_shard={k.n_shard} needs device buffers to gather its chunks into; "
                             f"n_buffer is 0")
        if self.blocks is not None and len(self.blocks) != n:
            raise ValueError(f"Plan.blocks names {len(self.blocks)} blocks and block_modes "
                             f"{modes_string(self.block_modes)} {n}")


    # ---- explanation ----------------------------------------------------------------------
    def _chunk_rows(self, pin) -> list[tuple[str, str, str, str]]:
        """``explain``'s rows of the chunk knobs: their size, where they are, the buffers."""
        k, c = self.knobs, self.chunks
        return [
            ("chunk_size", f"{fmt_bytes(k.chunk_size)}{pin('chunk_size')}",
             f"{c.n_chunks} chunks of {c.chunk_numel / 1e6:.1f} M elements",
             "DS stage3_prefetch_bucket_size, reduce_bucket_size, sub_group_size"),
            ("n_persist", f"{k.n_persist}{pin('n_persist')}",
             f"{k.n_persist}/{c.n_chunks} chunks stay on device, updated by device Adam",
             "DS offload_param, offload_optimizer, stage3_param_persistence_threshold"),
            *([("n_shard", f"{k.n_shard}{pin('n_shard')}",
                f"{k.n_shard} of them sharded over the {self.world} ranks: 1/{self.world} of their "
                f"states on each device, gathered into a buffer ahead of use",
                "DS ZeRO-3 without offload (stage3_param_persistence_threshold)")]
              if k.n_shard or "n_shard" in self.pinned else []),
            ("n_buffer", f"{k.n_buffer}{pin('n_buffer')}",
             f"device buffers for the {c.n_chunks - k.n_persist} offloaded chunks"
             + (f" and the {k.n_shard} sharded ones" if k.n_shard else ""),
             "DS stage3_max_live_parameters, stage3_max_reuse_distance")]

    def explain(self) -> str:
        """A compact table: the knobs chosen, the framework knobs they replace, the predicted
        time and memory, and the runner-up plans."""
        k, p, c = self.knobs, self.prediction, self.chunks
        n_blocks = len(self.block_modes)
        pin = lambda name: " (pinned)" if name in self.pinned else ""  # noqa: E731
        rows = [
            *self._chunk_rows(pin),
            ("n_checkpoint", f"{k.n_checkpoint}{pin('n_checkpoint')}",
             f"{k.n_checkpoint}/{n_blocks} blocks recomputed",
             "DS activation_checkpointing; Megatron --recompute-granularity/-method/-num-layers"),
            *([("ckpt_input", f"{k.ckpt_input}{pin('ckpt_input')}",
                f"the {k.n_checkpoint} checkpointed blocks keep their inputs "
                + {"host": "in pinned host memory, fetched back one block ahead of their backward",
                   "drive": "on the drive (ssd_path), read back one block ahead of their backward",
                   "device": "on the device"}[k.ckpt_input],
                "HF gradient_checkpointing_kwargs offload; DS cpu_checkpointing")]
              if k.ckpt_input != "device" or "ckpt_input" in self.pinned else []),
            ("n_swap", f"{k.n_swap}{pin('n_swap')}", f"{k.n_swap}/{n_blocks} blocks swapped to host",
             "Megatron --cpu-offloading(-num-layers); no DeepSpeed equivalent"),
        ]
        if self.n_speculate:
            rows.append(("n_speculate", str(self.n_speculate),
                         f"{self.n_speculate}/{c.n_chunks - k.n_persist} offloaded chunks run CPU Adam "
                         f"during backward before the clipping / overflow verdict (undone if wrong)",
                         "none (DS overlaps CPU Adam only without clipping)"))
            if p.iter_time_unspeculated:
                rows.append(("", "", f"iteration {fmt_seconds(p.iter_time)} if the step does not clip, "
                             f"{fmt_seconds(p.iter_time_rolled_back)} if it does (undone, redone); "
                             f"{fmt_seconds(p.iter_time_unspeculated)} after a clipped step "
                             f"(no speculation then)", ""))
        if k.n_nvme or "n_nvme" in self.pinned:
            rows.append(("n_nvme", f"{k.n_nvme}{pin('n_nvme')}",
                         f"states of {k.n_nvme}/{c.n_chunks - k.n_persist} offloaded chunks on NVMe "
                         f"({fmt_bytes(p.nvme_state_bytes)} of drive; {fmt_bytes(p.nvme_state_io_bytes)} "
                         f"read + written per step; staging {fmt_bytes(p.staging_bytes)} of host)",
                         "DS offload_optimizer device nvme, aio, buffer_count (ZeRO-Infinity)"))
        if k.n_ssd or "n_ssd" in self.pinned:
            rows.append(("n_ssd", f"{k.n_ssd}{pin('n_ssd')}", f"{k.n_ssd}/{n_blocks} blocks to NVMe "
                         f"({fmt_bytes(p.ssd_bytes)} per iteration)", "none (SSDTrain)"))
        if k.n_selective or "n_selective" in self.pinned or k.sequence_parallel > 1:
            rows.append(("n_selective", f"{k.n_selective}{pin('n_selective')}",
                         f"{k.n_selective}/{n_blocks} blocks keep attention outputs, recompute the rest",
                         "AutoSP's long-context checkpointing (DS autosp pass: fixed threshold)"))
        if k.sequence_parallel > 1 or "sequence_parallel" in self.pinned:
            rows.append(("sequence_parallel", f"{k.sequence_parallel}{pin('sequence_parallel')}",
                         f"each sequence split over {k.sequence_parallel} rank(s) (Ulysses)",
                         "DS sequence_parallel_size"))
        if k.head_tile or "head_tile" in self.pinned:
            rows.append(("head_tile", f"{k.head_tile}{pin('head_tile')}",
                         f"head and loss over tiles of {k.head_tile} tokens, recomputed in backward "
                         f"(training outputs carry logits=None)"
                         if k.head_tile else "the model's own head (whole logits)",
                         "DS TiledFusedLogitsLoss / ALST's tiled logits+loss (by hand)"))
        if k.mlp_tile or "mlp_tile" in self.pinned:
            rows.append(("mlp_tile", f"{k.mlp_tile}{pin('mlp_tile')}",
                         f"every block's MLP{' with its norm' if self.mlp_with_norm else ''} over tiles of "
                         f"{k.mlp_tile} tokens, recomputed in backward"
                         if k.mlp_tile else "the model's own MLPs (whole sequence)",
                         "DS TiledMLP / ALST's tiled MLP (by hand)"))
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        w2 = max(len(r[2]) for r in rows)
        out = [f"ProTrain plan for {self.model}",
               f"  machine: {self.machine}" + (
                   "" if self.ranks_per_node <= 1 or "ranks per node" in self.machine
                   else f"; host shared by {self.ranks_per_node} ranks per node"),
               f"  {'knob':<{w0}}  {'value':<{w1}}  {'meaning':<{w2}}  replaces"]
        out += [f"  {a:<{w0}}  {b:<{w1}}  {m:<{w2}}  {r}" for a, b, m, r in rows]
        out.append(f"  block modes (N keep, C checkpoint, H / F checkpoint from host / drive, S swap, D NVMe, A selective): "
                   f"{modes_string(self.block_modes)}")
        budget = self.device_memory
        if p.grad_accumulation_steps > 1:
            sp = k.sequence_parallel
            per = (f" (each micro-batch is {sp} sequence-parallel sub-steps of 1/{sp} of its "
                   f"tokens per rank)" if sp > 1 else "")
            out.append(f"  predicted optimizer step {fmt_seconds(p.step_time)} = "
                       f"{p.grad_accumulation_steps - 1} x {fmt_seconds(p.micro_step_time)} "
                       f"accumulating + the boundary micro-step below{per}")
        out.append(
            f"  predicted: iteration {fmt_seconds(p.iter_time)} (forward {fmt_seconds(p.fwd_time)}, "
            f"backward {fmt_seconds(p.bwd_time)}, device Adam {fmt_seconds(p.gpu_optim_time)}, "
            f"CPU Adam {fmt_seconds(p.cpu_optim_time)} with {fmt_seconds(p.cpu_optim_exposed)} exposed)")
        out.append(
            f"  predicted peak device memory {fmt_bytes(p.peak_device_bytes)} (model states "
            f"{fmt_bytes(p.model_state_bytes)} + activations {fmt_bytes(p.activation_peak_bytes)}"
            + (f" + clipping norm scratch {fmt_bytes(p.norm_scratch_bytes)}" if p.norm_scratch_bytes else "")
            + f", at {p.peak_at}); with {self.memory_margin:.0%} margin "
            f"{fmt_bytes(p.peak_device_bytes * (1 + self.memory_margin))} of {fmt_bytes(budget)}")
        out.append(f"  host memory {fmt_bytes(p.host_bytes)} of "
                   f"{host_budget_text(self.host_memory, self.node_host_memory, self.ranks_per_node)} "
                   f"(swapped activations {fmt_bytes(p.swap_host_bytes)}); per iteration H2D "
                   f"{fmt_bytes(p.h2d_bytes)}, D2H {fmt_bytes(p.d2h_bytes)}")
        if self.alternatives:
            # The drive's column where states are on it (a table without it reads as before).
            nvme = k.n_nvme > 0 or any(a.knobs.n_nvme for a in self.alternatives)
            out.append("  runner-ups:  chunk      persist buffer ckpt swap  ssd  sel  "
                       + ("nvme " if nvme else "") + "iteration   peak        host")
            for a in self.alternatives:
                ak = a.knobs
                out.append(f"               {fmt_bytes(ak.chunk_size):<10} {ak.n_persist:<7} "
                           f"{ak.n_buffer:<6} {ak.n_checkpoint:<4} {ak.n_swap:<5} {ak.n_ssd:<4} "
                           f"{ak.n_selective:<4} " + (f"{ak.n_nvme:<4} " if nvme else "") +
                           f"{fmt_seconds(a.iter_time):<11} {fmt_bytes(a.peak_device_bytes):<11} "
                           f"{fmt_bytes(a.host_bytes)}")
        out.append(f"  search: {self.candidates_total} candidates, {self.candidates_evaluated} "
                   f"simulated, {fmt_seconds(self.search_seconds)} ({self.profile_source} profile)")
        out += [f"  note: {n}" for n in self.notes]
        return "\n".join(out)

"""Evaluation: what a plan costs by the time model (cost.time_model) and the memory model - the
step time of candidate points as the search ranks them (``simulate_points``, with the count of
speculating chunks chosen by ``boundary_times``), and the full Plan with its predictions for
given knobs (``evaluate``), one function for both so the two cannot disagree."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..block_mode import BlockMode, layout_block_modes, modes_string, same_counts
from ..config import PlannerConfig
from ..cost.memory import MemoryPrediction, activation_file_space, ckpt_input_bytes, offload_bytes, predict_memory
from ..cost.predicted_timeline import predicted_timeline
from ..cost.time_model import simulate
from ..layout import build_layout
from ..plan import ChunkSummary, Knobs, Plan, Prediction, host_budget_text
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from ..profile.transforms import with_head_tile, with_mlp_tile
from ..state_tier import NVME_STATE_SLOTS
from ..cost.host_share import host_memory_share, nvme_free_share
from ..units import fmt_bytes
from .bounds import SpeculatingIterationBound, backward_bound, backward_compute, host_checks
from .candidates import ActivationConfigs, CandidateGrid
from .infeasible import InfeasibleError
from .policy import (carries_over, checks_on_host, drive_states_possible,
                     host_backup_bytes, norm_scratch, planned_state_bytes, speculates, speculation_max)

_PRUNE_MARGIN = 1e-6
"""How far a speculating count's lower bound must lie above the time of all that fit before
it is not simulated (``boundary_times``): far beyond the rounding between a bound and a
simulation, so a count that could tie - and win the tie, being smaller - is always simulated."""


def bytes_moved(t, micro, gas: int, ssd: np.ndarray, hw: HardwareProfile, state_io=0.0) -> np.ndarray:
    """Bytes moved per optimizer step by simulated plans (``t``: the boundary micro-step's
    TimePrediction, ``micro``: the accumulating one's or None): host <-> device copies, and
    the NVMe traffic (written and read back) that does not pass through them (GPUDirect),
    and ``state_io``: the optimizer states read from the drive and written back.
    The search computes the same in closed form (``CandidateGrid.moved``)."""
    per = lambda x: x.h2d_bytes + x.d2h_bytes + (2.0 * ssd if hw.nvme_gds else 0.0)  # noqa: E731
    return per(t) + ((gas - 1) * per(micro) if micro is not None else 0.0) + state_io


def boundary_times(profile, layout, hw, config, n_persist, n_buffer, codes, host_bytes, n_nvme=0, n_shard=0):
    """(iteration time, offloaded chunks speculating) of each plan's boundary micro-step: what
    the search ranks and ``evaluate`` predicts, one function for both.

    Without speculation the count is 0. With it (clipping / fp16 loss scaling): the pin, else
    the fastest of three counts whose backups fit the host memory left (ties: fewer) - none;
    all of them; and the chunks whose backup is done before backward ends when all speculate
    (a chunk whose backup is not only delays the updates left for after backward by it: the
    count where the curve turns, read off that one simulation, as the CPU reaches the chunks
    in the same order whichever of the later ones speculate)."""
    world = config.data_parallel_size
    k = len(np.atleast_1d(n_persist))
    npers = np.broadcast_to(np.asarray(n_persist, dtype=np.int64), (k,))
    nbuf = np.broadcast_to(np.asarray(n_buffer, dtype=np.int64), (k,))
    codes = np.broadcast_to(codes, (k, codes.shape[-1]))
    nnvme = np.broadcast_to(np.asarray(n_nvme, dtype=np.int64), (k,))
    nshard = np.broadcast_to(np.asarray(n_shard, dtype=np.int64), (k,))

    def run(n_spec, rows=slice(None)):
        return simulate(profile, layout, hw, npers[rows], nbuf[rows], codes[rows],
                        cpu_overlap=config.cpu_optim_overlap, world=world, n_nvme=nnvme[rows],
                        n_shard=nshard[rows],
                        carry_over=carries_over(config, hw), checks_on_host=checks_on_host(config),
                        speculate_from=layout.n_chunks - n_spec if n_spec is not None else None)
    if not speculates(config):
        return run(None).iter_time, np.zeros(k, dtype=np.int64)
    if config.speculate_chunks is not None:
        n = np.minimum(config.speculate_chunks, layout.n_chunks - npers)
        return run(n).iter_time, n
    n_fit = speculation_max(layout, hw, config, npers, host_bytes, nnvme)
    # Candidates in increasing count - none, the turn, all that fit - a later one winning only
    # if strictly faster. All that fit is simulated first (the turn is read off it), then the
    # turn; a smaller count whose lower bound (SpeculatingIterationBound) lies clearly above
    # the best of those cannot win, and is not simulated - for a model bound by its CPU Adam,
    # none (every update after backward) rarely can.
    some = np.flatnonzero(n_fit > 0)
    bounded = not config.cpu_optim_overlap and carries_over(config, hw) and len(some)
    if bounded:
        vb = SpeculatingIterationBound(profile, layout, hw, config, npers[some],
                                       backward_bound(profile, layout, hw, world, npers[some], nbuf[some],
                                                      backward_compute(profile, codes[some])),
                                       host_checks(layout, hw, config, npers[some]), nnvme[some])
    t_turn = np.full(k, np.inf)
    if len(some):
        every = run(n_fit[some], some)
        turn = np.minimum(every.spec_useful, n_fit[some])
        mid = np.flatnonzero((turn > 0) & (turn < n_fit[some]))
        if bounded:
            mid = mid[vb.at(turn)[mid] <= every.iter_time[mid] * (1 + _PRUNE_MARGIN)]
        if len(mid):
            t_turn[some[mid]] = run(turn[mid], some[mid]).iter_time
    rows = np.arange(k)
    if bounded:
        beaten = np.zeros(k, dtype=bool)
        beaten[some] = vb.at(0) > np.minimum(every.iter_time, t_turn[some]) * (1 + _PRUNE_MARGIN)
        rows = np.flatnonzero(~beaten)
    best, count = np.full(k, np.inf), np.zeros(k, dtype=np.int64)
    if len(rows):
        best[rows] = run(np.zeros(len(rows), dtype=np.int64), rows).iter_time
    if len(some):
        for r, n, t in ((some[mid], turn[mid], t_turn[some[mid]]), (some, n_fit[some], every.iter_time)):
            faster = t < best[r] * (1 - 1e-12)
            best[r] = np.where(faster, t, best[r])
            count[r] = np.where(faster, n, count[r])
    return best, count


def simulate_points(profile, hw, config, acts: ActivationConfigs, grid: CandidateGrid, idx: np.ndarray,
                    n_buffer=None) -> np.ndarray:
    """Time of one optimizer step: the boundary micro-step plus the others, if any."""
    return simulate_points_speculating(profile, hw, config, acts, grid, idx, n_buffer)[0]


def simulate_points_speculating(profile, hw, config, acts: ActivationConfigs, grid: CandidateGrid,
                                idx: np.ndarray, n_buffer=None) -> tuple[np.ndarray, np.ndarray]:
    """(``simulate_points``, each point's offloaded chunks speculating): the count ``evaluate``
    would pick again for the chosen point (``n_speculate``)."""
    nb = grid.n_buffer[idx] if n_buffer is None else n_buffer
    args = (profile, grid.layout, hw, grid.n_persist[idx], nb, acts.codes(grid.a[idx]))
    world = config.data_parallel_size
    t, n = boundary_times(*args[:2], hw, config, *args[3:], grid.host[idx], grid.n_nvme[idx], grid.n_shard[idx])
    if config.grad_accumulation_steps > 1:
        t = t + (config.grad_accumulation_steps - 1) * simulate(
            *args, optimizer_step=False, world=world, n_shard=grid.n_shard[idx]).iter_time
    return t, n


def _tiled(profile: ModelProfile, knob: str, tile: int, current: int, figures, unsupported: str,
           what: str, verb: str, transform) -> ModelProfile:
    """``profile`` with ``knob`` at ``tile`` (``transform``), or why a profile tiled otherwise or
    without the tiled figures cannot give it."""
    if tile == current:
        return profile
    if current or figures is None:
        raise InfeasibleError(
            f"{knob}={tile}: the profile's {what} "
            + (f"{verb} tiled at {current} tokens" if current else
               f"cannot be tiled ({unsupported or 'not measured'})")
            + f"; use {knob}=0" + ("" if current else f" (the model's own {what})"))
    return transform(profile, tile)


def evaluate(profile: ModelProfile, hw: HardwareProfile, knobs: Knobs,
             config: PlannerConfig | None = None, *, alternatives=(), search_seconds=0.0,
             evaluated=1, total=1, check_fit: bool = False,
             block_modes: tuple[BlockMode, ...] | None = None, n_speculate: int | None = None) -> Plan:
    """The Plan (with predictions) for given knobs, e.g. a plan loaded from a file replayed on
    a new profile. With ``check_fit`` raise InfeasibleError if it does not fit. ``block_modes``
    replaces ProTrain's block layout for the same counts (a framework that can only checkpoint
    the first blocks natively, as Megatron's ``--recompute-method block``). ``n_speculate``:
    the offloaded chunks speculating, where the search simulated these knobs and knows the
    count ``boundary_times`` picks (three simulations saved); else it is picked here."""
    config = config or PlannerConfig()
    profile = _tiled(profile, "head_tile", knobs.head_tile, profile.head_tile, profile.head,
                     profile.head_unsupported, "head", "is", with_head_tile)
    profile = _tiled(profile, "mlp_tile", knobs.mlp_tile, profile.mlp_tile, profile.mlp,
                     profile.mlp_unsupported, "MLPs", "are", with_mlp_tile)
    hw = hw.with_limits(device_memory=config.device_memory, host_memory=config.host_memory)
    layout = build_layout(profile, knobs.chunk_size // profile.param_bytes)
    modes = _checked_block_modes(profile, layout, knobs, block_modes)
    if knobs.n_nvme and not drive_states_possible(config, hw):
        raise InfeasibleError(f"n_nvme={knobs.n_nvme} puts optimizer states on the drive, and no drive "
                              f"is configured (ssd_path; protrain plan --nvme GB/s) or the framework "
                              f"keeps the model states; use n_nvme=0")
    if not 0 <= knobs.n_nvme <= layout.n_chunks - knobs.n_persist:
        raise InfeasibleError(f"n_nvme={knobs.n_nvme}: states on the drive are those of offloaded chunks, "
                              f"from 0 to {layout.n_chunks - knobs.n_persist} (n_persist={knobs.n_persist} "
                              f"of {layout.n_chunks} chunks)")
    codes = np.array([[m.code for m in modes]], dtype=np.int8)
    mem, n_spec = _predicted_memory(profile, hw, config, layout, knobs, modes, codes, n_speculate)
    pred, timeline = _predicted_step(profile, hw, config, layout, knobs, codes, mem, n_spec)
    if check_fit:
        _check_fit(hw, config, knobs, mem, profile.n_blocks)
    return Plan(
        knobs=knobs, block_modes=modes,
        chunks=ChunkSummary(n_chunks=layout.n_chunks, chunk_numel=layout.chunk_numel,
                            total_numel=layout.total_numel, min_persist=layout.min_persist),
        prediction=pred, model=profile.describe(), machine=hw.describe(),
        device_memory=hw.device_memory, host_memory=host_memory_share(hw), node_host_memory=hw.host_memory,
        memory_margin=config.memory_margin, param_bytes=profile.param_bytes, world=config.data_parallel_size,
        profile_source=profile.source, pinned=tuple(sorted(config.pins.pinned())),
        alternatives=tuple(alternatives), search_seconds=search_seconds,
        candidates_evaluated=int(evaluated), candidates_total=int(total),
        params=profile.params if profile.source == "measured" else (),
        block_saved_bytes=tuple(offload_bytes(b) for b in profile.blocks),
        block_input_bytes=tuple(ckpt_input_bytes(b) for b in profile.blocks),
        mlp_with_norm=bool(knobs.mlp_tile and profile.mlp is not None and profile.mlp.with_norm),
        micro_batch=profile.micro_batch, seq_len=profile.seq_len, n_speculate=n_spec,
        timeline=timeline, ranks_per_node=hw.ranks_per_node)


def _checked_block_modes(profile: ModelProfile, layout, knobs: Knobs,
                         block_modes: tuple[BlockMode, ...] | None) -> tuple[BlockMode, ...]:
    """The knobs' block modes (``block_modes`` where given and of the same counts), after
    refusing knobs the layout cannot run."""
    modes = layout_block_modes(profile.n_blocks, knobs.n_swap, knobs.n_checkpoint, knobs.n_ssd,
                               knobs.n_selective, knobs.ckpt_input)
    if block_modes is not None:
        if len(block_modes) != profile.n_blocks or not same_counts(block_modes, modes):
            raise ValueError(f"block_modes {modes_string(block_modes)} do not match the knobs {knobs} "
                             f"for {profile.n_blocks} blocks")
        modes = tuple(block_modes)
    if knobs.n_selective and not profile.has_selective:
        raise InfeasibleError(f"n_selective={knobs.n_selective}: the profile has no selective-mode "
                              f"measurements (no attention operator seen in the blocks); use 0")
    if not layout.min_persist <= knobs.n_persist <= layout.n_chunks:
        raise InfeasibleError(f"n_persist={knobs.n_persist} must be between {layout.min_persist} "
                              f"and the {layout.n_chunks} chunks of this layout")
    replicated = knobs.n_persist - knobs.n_shard
    if not layout.min_persist <= replicated:
        raise InfeasibleError(f"n_shard={knobs.n_shard}: the first {layout.min_persist} chunks stay whole "
                              f"on every device (parameters used by parts that are not adjacent), so at "
                              f"most {max(knobs.n_persist - layout.min_persist, 0)} of the n_persist="
                              f"{knobs.n_persist} may be sharded")
    nb_min = layout.min_buffers(replicated)
    offloaded = layout.n_chunks - replicated
    if knobs.n_buffer > offloaded:
        raise InfeasibleError(f"n_buffer={knobs.n_buffer} is more than the {offloaded} offloaded or sharded "
                              f"chunk(s) (n_persist={knobs.n_persist} of {layout.n_chunks}); use at "
                              f"most {offloaded}")
    if knobs.n_buffer < nb_min:
        raise InfeasibleError(f"n_buffer={knobs.n_buffer} is below {nb_min}, the chunks one block "
                              f"spans with n_persist={knobs.n_persist}; use at least {nb_min}")
    return modes


def _predicted_memory(profile, hw, config, layout, knobs: Knobs, modes, codes,
                      n_speculate: int | None = None) -> tuple[MemoryPrediction, int]:
    """(the memory model's prediction, offloaded chunks speculating - ``n_speculate`` where
    known): the host holds the speculating chunks' backups too."""
    world = config.data_parallel_size
    mem = predict_memory(profile, layout, knobs.n_persist, knobs.n_buffer, modes,
                         planned_state_bytes(profile, config), world,
                         norm_scratch=int(norm_scratch(profile, config, layout)[knobs.n_persist]),
                         n_nvme=knobs.n_nvme, n_shard=knobs.n_shard)
    if config.model_states_fixed is not None:
        mem = replace(mem, model_state_bytes=config.model_states_fixed, host_bytes=mem.swap_host_bytes,
                      peak_device_bytes=config.model_states_fixed + mem.activation_peak_bytes)
    n_spec = n_speculate if n_speculate is not None else int(boundary_times(
        profile, layout, hw, config, knobs.n_persist, knobs.n_buffer, codes, mem.host_bytes, knobs.n_nvme,
        knobs.n_shard)[1][0])
    mem = replace(mem, host_bytes=mem.host_bytes + int(host_backup_bytes(layout, world, n_spec, knobs.n_nvme)))
    return mem, n_spec


def _predicted_step(profile, hw, config, layout, knobs: Knobs, codes, mem: MemoryPrediction, n_spec: int):
    """(Prediction, the predicted timeline) of the step: the boundary micro-step as it
    speculates, as it would without speculating and when its speculation is rolled back, and
    the accumulating micro-steps."""
    world = config.data_parallel_size
    spec_from = layout.n_chunks - n_spec if speculates(config) else None
    timed = lambda rows=1, **kw: simulate(  # noqa: E731
        profile, layout, hw, knobs.n_persist, knobs.n_buffer, np.repeat(codes, rows, axis=0),
        cpu_overlap=config.cpu_optim_overlap, world=world, carry_over=carries_over(config, hw),
        checks_on_host=checks_on_host(config), n_nvme=knobs.n_nvme, n_shard=knobs.n_shard, **kw)
    trace: list = []
    # The runtime's rule: a step after one that clipped (or overflowed) does not speculate; a
    # speculated step that clips restores and redoes its chunks. The step as it speculates
    # (traced: the first plan) and as it would without, in one simulation of two plans.
    if n_spec:
        t = timed(2, speculate_from=np.array([spec_from, layout.n_chunks]), trace=trace)
        unspeculated, exposed_unspeculated = float(t.iter_time[1]), float(t.cpu_optim_exposed[1])
    else:
        t = timed(speculate_from=spec_from, trace=trace)
        unspeculated, exposed_unspeculated = float(t.iter_time[0]), float(t.cpu_optim_exposed[0])
    rolled_back = float((timed(speculate_from=spec_from, speculation_wrong=True) if n_spec
                         else t).iter_time[0])
    timeline = predicted_timeline(
        profile, codes, t, trace, model_state_bytes=mem.model_state_bytes, memory_limit=hw.device_memory,
        title=f"{profile.name}: {layout.n_chunks - knobs.n_persist} of {layout.n_chunks} chunks "
              f"offloaded, {knobs.n_shard} sharded, blocks ckpt {knobs.n_checkpoint} swap {knobs.n_swap} ssd {knobs.n_ssd} "
              f"sel {knobs.n_selective}")
    gas = config.grad_accumulation_steps
    micro = float(simulate(profile, layout, hw, knobs.n_persist, knobs.n_buffer, codes,
                           optimizer_step=False, world=world, n_shard=knobs.n_shard).iter_time[0]) if gas > 1 else float(t.iter_time[0])
    f = lambda a: float(a[0])  # noqa: E731
    pred = Prediction(
        iter_time=f(t.iter_time), step_time=f(t.iter_time) + (gas - 1) * micro,
        micro_step_time=micro, grad_accumulation_steps=gas,
        fwd_time=f(t.fwd_time), bwd_time=f(t.bwd_time),
        gpu_optim_time=f(t.gpu_optim_time), cpu_optim_time=f(t.cpu_optim_time),
        cpu_optim_exposed=f(t.cpu_optim_exposed), peak_device_bytes=mem.peak_device_bytes,
        model_state_bytes=mem.model_state_bytes, activation_peak_bytes=mem.activation_peak_bytes,
        peak_at=mem.peak_at, host_bytes=mem.host_bytes, swap_host_bytes=mem.swap_host_bytes,
        h2d_bytes=int(t.h2d_bytes[0]), d2h_bytes=int(t.d2h_bytes[0]), ssd_bytes=mem.ssd_bytes,
        iter_time_unspeculated=unspeculated, cpu_optim_exposed_unspeculated=exposed_unspeculated,
        iter_time_rolled_back=rolled_back,
        norm_scratch_bytes=mem.norm_scratch_bytes, nvme_state_bytes=mem.nvme_state_bytes,
        nvme_state_io_bytes=mem.nvme_state_io_bytes, staging_bytes=mem.staging_bytes)
    return pred, timeline


def drive_space_message(hw: HardwareProfile, config: PlannerConfig, need: int, *, what: str) -> str:
    """Why ``need`` bytes per rank (activations and optimizer states) do not fit the drive."""
    rpn = max(1, hw.ranks_per_node)
    share = f", shared by {rpn} ranks per node: {fmt_bytes(nvme_free_share(hw))} each" if rpn > 1 else ""
    held = (f" while this run's current state file ({fmt_bytes(hw.nvme_held_bytes)} per rank) is on "
            f"it: a re-plan moves the states from that file into the new plan's, so it needs room "
            f"for both" if hw.nvme_held_bytes else "")
    avoid = ("; or plan for the longest batch from the start (protrain.max_seq_len) so that no "
             "re-plan is needed" if hw.nvme_held_bytes else "")
    return (f"{what} puts {fmt_bytes(need)} on the drive per rank (activations and the optimizer "
            f"states' file, {NVME_STATE_SLOTS} places per chunk; {fmt_bytes(need * (1 + config.memory_margin))} "
            f"with the {config.memory_margin:.0%} margin), but the SSD path has "
            f"{fmt_bytes(hw.nvme_free_bytes)} free{share}{held}. Free space under ssd_path (or give "
            f"--nvme-free the drive's free space), point ssd_path at a larger drive, or add host "
            f"memory{avoid}")


def _check_fit(hw: HardwareProfile, config: PlannerConfig, knobs: Knobs, mem: MemoryPrediction,
               n_blocks: int) -> None:
    """Refuse a plan that does not fit the device (with the margin), this rank's share of the
    node's host memory or of the drive (the activations' block files as the runtime sizes them,
    ``activation_file_space``)."""
    need = mem.peak_device_bytes * (1 + config.memory_margin)
    drive = int(activation_file_space(mem.ssd_bytes, n_blocks)) + mem.nvme_state_bytes
    if drive and drive * (1 + config.memory_margin) > nvme_free_share(hw):
        if not mem.nvme_state_bytes and hw.ranks_per_node <= 1:
            raise InfeasibleError(f"plan {knobs} writes {fmt_bytes(mem.ssd_bytes)} of activations "
                                  f"to NVMe but the SSD path has {fmt_bytes(hw.nvme_free_bytes)} free")
        raise InfeasibleError(drive_space_message(hw, config, drive, what=f"plan {knobs}"))
    if need > hw.device_memory or mem.host_bytes > host_memory_share(hw):
        raise InfeasibleError(
            f"plan {knobs} needs {fmt_bytes(need)} device (with margin) and "
            f"{fmt_bytes(mem.host_bytes)} host memory, but {fmt_bytes(hw.device_memory)} device and "
            f"{host_text(hw)} host memory are available",
            device_needed=int(need), host_needed=mem.host_bytes)


def host_text(hw: HardwareProfile) -> str:
    """The host memory a rank may plan for, in words: its share of the node's where several
    ranks share it (``plan.host_budget_text``)."""
    return host_budget_text(host_memory_share(hw), hw.host_memory, hw.ranks_per_node)

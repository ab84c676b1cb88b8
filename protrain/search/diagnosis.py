"""The diagnosis of a search that found no plan: which constraint rules every plan out and
what to change - the pins (would it fit without them? which constraint breaks the one plan
they name?), the host memory the offloaded states need, or the device memory the leanest plan
needs, with the micro-batch or sequence length that would fit."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from ..config import ALL, KNOB_NAMES, KnobPins, PlannerConfig

from ..cost.host_share import host_memory_share
from ..cost.memory import buffer_numel
from ..layout import build_layout
from ..plan import Knobs, Plan
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from ..units import fmt_bytes
from .candidates import ActivationConfigs
from .evaluation import drive_space_message, evaluate, host_text
from .infeasible import InfeasibleError
from .policy import drive_states_possible, norm_scratch, planned_state_bytes
from .sharding import least_device_states, most_sharded, shards
from .space import candidate_capacities, model_state_bytes

Search = Callable[[ModelProfile, HardwareProfile, PlannerConfig], Plan]
"""The search itself (``search.loop.search``), handed in by its caller: the diagnosis names
the plan it finds without the pins, and the search calls the diagnosis."""
Fits = Callable[[ModelProfile, HardwareProfile, PlannerConfig], bool]
"""Whether any point fits (``search.loop.fits``): the model without the pins, cheaply."""


def diagnose_infeasible(profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig, budget: float,
                        stats: dict, acts: ActivationConfigs, caps, *, search: Search,
                        fits: Fits) -> InfeasibleError:
    """The error to raise when no point of any chunk size (``caps``) fits: ``budget`` is the
    device memory less the margin, ``stats`` what the grids' nearest misses needed
    (``space.candidate_grid``)."""
    if config.pins.pinned():
        pinned = _pinned_diagnosis(profile, hw, config, stats, search, fits)
        if pinned is not None:
            return pinned
    return _binding_resource(profile, hw, config, stats) or _device_diagnosis(profile, hw, config, budget,
                                                                              acts, caps)


def _binding_resource(profile, hw, config: PlannerConfig, stats: dict) -> InfeasibleError | None:
    """The drive or the host memory, where one of them rules out every point that fit the
    device (``stats``: what the nearest misses needed), with its fix; None: no point fit the
    device."""
    if "host_needed" in stats and stats["host_needed"] <= host_memory_share(hw) and "drive_needed" in stats:
        need = int(stats["drive_needed"])
        return InfeasibleError(drive_space_message(hw, config, need, what="the plan that needs the least drive"))
    if "host_needed" in stats:
        need = int(stats["host_needed"])
        return InfeasibleError(_host_message(profile, hw, config, need, int(stats.get("host_backups", 0))),
                               host_needed=need)
    return None


def _host_message(profile, hw, config: PlannerConfig, need: int, backups: int = 0) -> str:
    """Host memory too small: what the states need, and what to do - the drive among it.
    ``backups``: of ``need``, the speculation backups a pinned ``speculate_chunks`` holds (the
    first thing to change where the rest fits: the planner speculates within the budget).
    ``need`` is per rank, against the rank's share of the node's host memory."""
    spec = (f"{fmt_bytes(backups)} of it the speculation backups (12 bytes per parameter) of the "
            f"chunks speculate_chunks={config.speculate_chunks} makes speculate" if backups else "")
    have = host_text(hw)
    if backups and need - backups <= host_memory_share(hw):
        return (f"host memory too small: the plan that needs the least host memory needs "
                f"{fmt_bytes(need)}, {spec}, but {have} is available. Pin "
                f"speculate_chunks lower, or leave it on auto (the planner speculates with the "
                f"chunks whose backups fit the host memory left)")
    spec = f" ({spec}: pin speculate_chunks lower, or leave it on auto)" if backups else ""
    sb = planned_state_bytes(profile, config)
    if drive_states_possible(config, hw) and config.pins.n_nvme is None:
        return (f"host memory too small: even with every offloaded chunk's optimizer states on the "
                f"drive, the offloaded parameters and gradients ({sb.host - sb.nvme} bytes per "
                f"offloaded parameter) and the staging ring need at least {fmt_bytes(need)} of host "
                f"memory{spec}, but {have} is available. {_more_host(hw, need)}, shard the states "
                f"over more data-parallel ranks, or train a smaller model.")
    drive = ("" if drive_states_possible(config, hw) or config.model_states_fixed is not None else
             f" Or set ssd_path (protrain.ssd_path; protrain plan --nvme GB/s) to put optimizer states "
             f"({sb.nvme} bytes per parameter) on the drive.")
    return (f"host memory too small: the offloaded model states "
            f"({sb.host} bytes per offloaded parameter) "
            f"need at least {fmt_bytes(need)} of host memory{spec}, but {have} is "
            f"available. {_more_host(hw, need)}, shard the states over more data-parallel ranks, "
            f"or train a smaller model.{drive}")


def _more_host(hw, need: int) -> str:
    """The first fix of a host memory too small for ``need`` bytes per rank: more of it, for
    the node's ranks together where several share it."""
    rpn = max(1, hw.ranks_per_node)
    more = ("Add host memory (or raise protrain.host_memory / --host-memory, the node's host "
            "memory, if the machine has more)")
    if rpn <= 1:
        return more
    return (f"{more}: the node's {rpn} ranks need {fmt_bytes(need * rpn)} together; or put fewer "
            f"ranks on each node")


def _pinned_diagnosis(profile, hw, config: PlannerConfig, stats: dict, search: Search,
                      fits: Fits) -> InfeasibleError | None:
    """What the pins break, where they are the problem."""
    too_many = _too_many_nvme_chunks(profile, config)
    if too_many is not None:
        return too_many
    # Where the checkpointed blocks keep their inputs is chosen around this search
    # (search/ckpt_input.py), which pins it here: it stays, and is not named as the user's pin.
    ckpt_input = config.pins.ckpt_input or "device"
    pins = {k: v for k, v in config.pins.pinned().items() if k != "ckpt_input"}
    if not pins:
        return None
    # Would it fit without the pins? Then the pins are the problem; say so. The plan the
    # planner finds without them is searched only if the message is read (the searches around
    # this one try variants whose errors are never shown).
    unpinned = replace(config, pins=KnobPins(ckpt_input=config.pins.ckpt_input))
    free = fits(profile, hw, unpinned)
    # The sequence-parallel degree is not this search's (it plans one rank's profile). Pins
    # on every other knob but n_selective (a configuration written before that knob) name
    # one plan too: the one without selective blocks (had it fit, the search found it); the
    # same for n_nvme (states on the drive came later): unpinned, no states on the drive.
    fixed = {k: v for k, v in pins.items() if k != "sequence_parallel"}
    fixed.setdefault("n_selective", 0)
    fixed.setdefault("n_nvme", 0)
    if not shards(replace(config, pins=KnobPins())):
        fixed.setdefault("n_shard", 0)          # one rank: nothing to shard over
    fixed["head_tile"] = profile.head_tile        # chosen around this search (search/head.py)
    fixed["mlp_tile"] = profile.mlp_tile          # and search/mlp.py
    fixed["ckpt_input"] = ckpt_input
    if len(fixed) == len(KNOB_NAMES) - 1:
        # Every knob fixed: say which constraint that one plan breaks.
        if pins["n_persist"] == ALL:     # "all": the chunk count of the pinned chunk size
            every = build_layout(profile, pins["chunk_size"] // profile.param_bytes).n_chunks
            pins, fixed = dict(pins, n_persist=every), dict(fixed, n_persist=every)
        try:
            evaluate(profile, hw, Knobs(**fixed), config, check_fit=True)
        except InfeasibleError as e:
            return InfeasibleError(f"the pinned plan does not work: {e}",
                                   device_needed=e.device_needed, host_needed=e.host_needed)
    if "buffers_needed" in stats:
        return InfeasibleError(
            f"pinned n_buffer={config.pins.n_buffer} is too few: with these chunks a part of the "
            f"model spans {stats['buffers_needed']} chunks, which must be on the device together. "
            f"Pin n_buffer >= {stats['buffers_needed']}, a larger chunk_size, or leave n_buffer on auto")
    if free:
        # Name what the pins run into, with its own fix, before the plan without them.
        binding = _binding_resource(profile, hw, config, stats)
        why = (str(binding).rstrip(".") if binding is not None else
               f"no plan with them fits the device memory ({fmt_bytes(hw.device_memory)}, less the "
               f"{config.memory_margin:.0%} margin)")

        def message() -> str:
            try:
                plan = search(profile, hw, unpinned)
                found = f"finds {plan.knobs} ({fmt_bytes(plan.prediction.peak_device_bytes)} peak)"
            except InfeasibleError:      # not expected: ``fits`` found a point
                found = "finds plans that fit"
            return (f"no plan fits with the pinned knobs {pins}: {why}. Without the pins the planner "
                    f"{found}: unpin them (set to \"auto\") or change the pinned values")
        return InfeasibleError(
            message, device_needed=binding.device_needed if binding is not None else None,
            host_needed=binding.host_needed if binding is not None else None,
            headline=f"no plan fits with the pinned knobs {pins}: {why}".split(";")[0])
    return None


def _too_many_nvme_chunks(profile, config: PlannerConfig) -> InfeasibleError | None:
    """A pinned n_nvme beyond the offloaded chunks of every chunk size tried: named with the
    most there are (states on the drive are those of offloaded chunks only)."""
    want = config.pins.n_nvme
    if not want:
        return None
    most, at = 0, None
    for cap in candidate_capacities(profile, config):
        layout = build_layout(profile, cap)
        persist = config.pins.n_persist
        persist = layout.n_chunks if persist == ALL else layout.min_persist if persist is None else persist
        if layout.n_chunks - persist >= most:
            most, at = layout.n_chunks - persist, layout
    if want <= most:
        return None
    where = (f"{at.n_chunks} chunks of {fmt_bytes(at.chunk_bytes)}, at least "
             f"{at.n_chunks - most} of them on the device" if at is not None else "no chunk size tried")
    return InfeasibleError(
        f"pinned n_nvme={want} exceeds the offloaded chunks: states on the drive are those of "
        f"offloaded chunks, and at most {most} can be offloaded ({where}). Pin n_nvme between "
        f"0 and {most}, a smaller chunk_size or fewer persistent chunks (n_persist), or leave "
        f"n_nvme on auto")


def _device_diagnosis(profile, hw, config: PlannerConfig, budget: float, acts, caps) -> InfeasibleError:
    """The device memory the leanest plan needs, and the micro-batch or sequence length that
    would fit the device."""
    margin = config.memory_margin
    need, states = _leanest(profile, config, acts, caps, host_memory_share(hw))
    device_needed = int(np.ceil(need * (1 + margin)))
    msg = (f"device memory too small: the leanest plan that fits {host_text(hw)} of "
           f"host memory (blocks checkpointed or swapped, as many chunks offloaded as the host "
           f"takes) peaks at {fmt_bytes(need)}, so it needs {fmt_bytes(device_needed)} with the "
           f"{margin:.0%} margin, but {fmt_bytes(hw.device_memory)} is available.")
    unbounded, _ = _leanest(profile, config, acts, caps, np.inf)
    if unbounded * (1 + margin) <= hw.device_memory:
        msg += (f" With more host memory it would fit: offloading every chunk needs "
                f"{fmt_bytes(profile.total_params * planned_state_bytes(profile, config).host)} of host memory.")
    fit = seq_fit = None
    act = need - states
    mb = profile.micro_batch
    if act > 0 and budget > states:
        scale = (budget - states) / act
        if mb:
            fit = int(np.floor(mb * scale))
            msg += (f" Lower the micro-batch from {mb} to {fit} or less" if fit >= 1 else
                    " Even micro-batch 1 does not fit; shorten the sequence")
            if profile.seq_len:
                seq_fit = int(profile.seq_len * min(scale, 1.0))
                msg += f" (or the sequence length from {profile.seq_len} to about {seq_fit})"
            msg += "."
        else:
            msg += f" Shrink the activations (micro-batch or sequence length) to {scale:.0%} or less."
    else:
        msg += (f" The model states (with their buffers and scratch) alone need {fmt_bytes(states)}: "
                f"use a device with more memory, more host memory, or shard over more data-parallel "
                f"ranks.")
    return InfeasibleError(msg, device_needed=device_needed, micro_batch_fit=fit if fit else None,
                           seq_len_fit=seq_fit)


def _leanest(profile, config, acts: ActivationConfigs, caps, host_memory) -> tuple[float, float]:
    """(peak, the part of it that does not grow with the batch: model states, buffers and
    the clipping norm's scratch) of the plan with the smallest device peak whose host needs
    fit ``host_memory`` (any n_persist, the fewest buffers). The scratch belongs with the
    states: counted as activations, it made the micro-batch and sequence length that fit look
    longer than they are (llama3-8b at 65536 tokens on an H100: "about 39552", where 39040 is
    the longest multiple of 128 that plans)."""
    best = (np.inf, np.inf)
    for cap in caps:
        layout = build_layout(profile, cap)
        nps = np.arange(layout.min_persist, layout.n_chunks + 1)
        persist, host_state = model_state_bytes(profile, config, layout)
        # With several ranks the device chunks the most sharded (and their buffers).
        states, host = least_device_states(profile, config, layout, persist)[nps], host_state[nps]
        if config.model_states_fixed is None:
            states = states + layout.min_buffers_table()[nps - most_sharded(config, layout, nps)] * \
                buffer_numel(layout, config.data_parallel_size) * planned_state_bytes(profile, config).buffer
        fixed = states + norm_scratch(profile, config, layout)[nps]
        peak = fixed[None, :] + acts.act_peak[:, None]
        ok = host[None, :] + acts.swap_host[:, None] <= host_memory
        if ok.any():
            a, j = np.unravel_index(np.where(ok, peak, np.inf).argmin(), peak.shape)
            best = min(best, (float(peak[a, j]), float(fixed[j])))
    return best

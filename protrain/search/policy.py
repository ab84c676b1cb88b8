"""What the runtime does under a PlannerConfig, as the planner's models need it: the bytes of
model state per parameter, the clipping norm's scratch, where CPU Adam's updates and the
step's verdict checks run, and how many chunks may speculate. One place, so that the
candidate space, the bounds and evaluation cannot disagree on it."""
from __future__ import annotations

import numpy as np

from ..config import PlannerConfig
from ..cost.host_share import host_memory_share
from ..cost.memory import StateBytes, norm_scratch_bytes, state_bytes
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile


def planned_state_bytes(profile: ModelProfile, config: PlannerConfig) -> StateBytes:
    """Bytes of model state per parameter: on the device, on the host, in a chunk buffer."""
    return state_bytes(profile.param_bytes, config.grad_accumulation_steps > 1, speculative_writes(config))


def norm_scratch(profile: ModelProfile, config: PlannerConfig, layout) -> np.ndarray:
    """Per n_persist: the clipping norm's fp32 scratch (none with the framework's own states)."""
    if config.model_states_fixed is not None:
        return np.zeros(layout.n_chunks + 1, dtype=np.int64)
    return norm_scratch_bytes(profile, layout, config.gradient_clipping, config.grad_accumulation_steps > 1)


def carries_over(config: PlannerConfig, hw: HardwareProfile) -> bool:
    """Whether CPU Adam left at the end of a step runs into the next forward (the runtime does,
    except with fixed model states; on a CPU "device" it runs inline anyway)."""
    return config.model_states_fixed is None and (hw.copy_engines > 0 or hw.cpu_adam_thread)


def weak_cpu_bound(config: PlannerConfig, hw: HardwareProfile) -> bool:
    """Whether CPU Adam may end after the step's device work by less than its chain through
    backward: updates carried into the next forward, which waits only for the chunks it
    uploads - those left for after backward (clipping, fp16), or those backward's gradients
    outran (the worker takes the lowest chunk first, so the next forward's first uploads
    find their updates done)."""
    return carries_over(config, hw)


def checks_on_host(config: PlannerConfig) -> bool:
    """Where the runtime takes the step's verdict inputs: on the host for accumulated
    gradients, else on the device before the gradients leave (runtime/optimizer.py)."""
    return config.grad_accumulation_steps > 1


def speculates(config: PlannerConfig) -> bool:
    """Whether CPU Adam may update chunks before the step's verdict (restoring them from a
    backup if it clips or overflows)."""
    return config.cpu_optim_speculative and config.model_states_fixed is None


def backup_from_top(layout, world: int) -> np.ndarray:
    """Host bytes of the backups of the last k chunks, at index k (12 bytes - master, exp_avg,
    exp_avg_sq - per parameter of this rank's shard)."""
    shard = -(-np.asarray(layout.used, dtype=np.int64) // world) * 12
    return np.concatenate([[0], np.cumsum(shard[::-1])])


def host_backup_bytes(layout, world: int, n_speculate, n_nvme) -> np.ndarray:
    """Host bytes of the backups of the last ``n_speculate`` chunks but the last ``n_nvme``:
    those with states on the drive speculate into their other slot there
    (``state_tier.NVME_STATE_SLOTS``), without a backup."""
    top = backup_from_top(layout, world)
    n_speculate = np.asarray(n_speculate)
    return top[n_speculate] - top[np.minimum(n_speculate, np.asarray(n_nvme))]


def pinned_speculation(layout, config: PlannerConfig, n_persist) -> np.ndarray:
    """Per n_persist: the offloaded chunks a pinned ``speculate_chunks`` makes speculate (their
    backups must fit the host budget like any other state: the search counts them in the
    host bytes); 0 where the count is the search's (``speculation_max`` fits it to the host
    memory left) or nothing speculates."""
    n_off = layout.n_chunks - np.asarray(n_persist)
    if not speculates(config) or config.speculate_chunks is None:
        return np.zeros_like(n_off)
    return np.minimum(config.speculate_chunks, n_off).clip(min=0)


def speculation_max(layout, hw: HardwareProfile, config: PlannerConfig, n_persist, host_bytes, n_nvme=0):
    """The most offloaded chunks a plan may speculate with (``evaluation.boundary_times`` picks
    among none, these, and a count in between): the pin, else those whose backups fit the host
    memory left of this rank's share (the ``n_nvme`` chunks with states on the drive need
    none); none without speculation."""
    n_off = layout.n_chunks - np.asarray(n_persist)
    if not speculates(config):
        return np.zeros_like(n_off)
    if config.speculate_chunks is not None:
        return np.minimum(config.speculate_chunks, n_off)
    top = backup_from_top(layout, config.data_parallel_size)
    room = host_memory_share(hw) - np.asarray(host_bytes, dtype=np.int64)
    k = np.asarray(n_nvme)
    fit = np.maximum(np.searchsorted(top, room + top[k], side="right") - 1, k)
    return np.minimum(n_off, fit).clip(min=0)


def speculative_writes(config: PlannerConfig) -> bool:
    """Whether NVMe chunks' write-backs carry the master from before a speculative update too
    (fp32 with speculation: ``state_tier.staged_bytes_per_element``)."""
    return speculates(config) and not config.cpu_optim_overlap


def drive_states_possible(config: PlannerConfig, hw: HardwareProfile) -> bool:
    """Whether offloaded chunks may keep their optimizer states on the drive: the runtime keeps
    the model states and a drive is configured (``ssd_path``: its bandwidths measured)."""
    return (config.model_states_fixed is None and hw.nvme_read_bandwidth > 0
            and hw.nvme_write_bandwidth > 0)

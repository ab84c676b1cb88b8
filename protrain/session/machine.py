"""The machine a plan is priced on: the node's probed figures, the SSD tier's, and the links
between the ranks (this rank's share of the host's memory: host_budget.py).

The links are measured by every rank together (a collective) once per process and world;
the rest by the deciding rank alone.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..profile.hardware import HardwareProfile
from ..runtime.collectives import DataParallel
from ..units import fmt_bytes

_LINKS: dict = {}


def probe_links(dp: DataParallel, device: torch.device) -> tuple[float, float]:
    """(all-gather, all-to-all) bandwidth between the ranks, measured once per process and
    world (every rank takes part: an engine built again in the same job does not re-measure)."""
    from ..measure.probe import probe_alltoall, probe_collective
    if dp.world == 1:
        return 0.0, 0.0
    key = (dp.world, str(device))
    if key not in _LINKS:
        _LINKS[key] = (probe_collective(dp, device), probe_alltoall(dp, device))
    return _LINKS[key]


def with_storage_and_links(hw: HardwareProfile, *, device: torch.device, ssd_path: str | None,
                           world: int, links: tuple[float, float], verbose: bool) -> HardwareProfile:
    """``hw`` (the node's figures) with the SSD tier at ``ssd_path`` measured now, and with
    several ranks the links between them (``probe_links``). This rank's host budget is the
    session's (``host_budget.with_host_budget``: its share of what the host can give)."""
    if ssd_path:
        from ..measure.probe import probe_storage
        ssd = probe_storage(ssd_path, device)
        if verbose:
            print(f"ProTrain: SSD tier at {ssd_path} via {ssd['backend']}: write "
                  f"{ssd['nvme_write_bandwidth'] / 1e9:.2f} GB/s, read "
                  f"{ssd['nvme_read_bandwidth'] / 1e9:.2f} GB/s "
                  f"({'each at once' if ssd['nvme_duplex'] else 'sharing the drive'}), "
                  f"{fmt_bytes(ssd['nvme_free_bytes'])} free", flush=True)
        hw = replace(hw, **{k: v for k, v in ssd.items() if k != "backend"})
    if world > 1:
        hw = replace(hw, collective_bandwidth=links[0], alltoall_bandwidth=links[1])
    return hw

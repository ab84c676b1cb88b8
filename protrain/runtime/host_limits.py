"""What host memory this process can have: the limits, which one binds, and the guard that
refuses a pinning allocation beyond them.

Offloaded chunk states, swapped activations and staging buffers live in pinned host memory,
and pinned pages cannot be swapped or reclaimed: an allocation beyond what the host can give
ends in the kernel's OOM killer (``-9``, no traceback: DeepSpeed issues 4571, 5290, 2918,
4380). The limits read here:

- ``MemAvailable`` (/proc/meminfo): what the kernel can hand out without swapping, node-wide;
- the memory cgroup the process is in (a container, a Slurm job): cgroup v2 ``memory.max``
  less the working set (``memory.current`` less the inactive file cache the kernel reclaims
  first), at this cgroup and each ancestor; cgroup v1 ``memory.limit_in_bytes`` (or the
  ``hierarchical_memory_limit`` over the ancestors) less ``memory.usage_in_bytes`` less
  ``total_inactive_file``;
- ``RLIMIT_MEMLOCK`` (``ulimit -l``), read and reported but not binding for CUDA's pinned
  memory: NVIDIA's driver locks the pages of cudaHostAlloc and cudaHostRegister with
  ``pin_user_pages(FOLL_LONGTERM)`` in ``os_lock_user_pages``
  (NVIDIA/open-gpu-kernel-modules, kernel-open/nvidia/os-mlock.c) and never charges the
  process's locked_vm, which is what ``mlock`` and ibverbs memory registration (``ib_umem_get``)
  check against the limit. torch's ``pin_memory`` works in a Docker container whose default
  ``ulimit -l`` is 64 KiB for that reason. ``MEMLOCK_BINDS_PINNING`` says so in one place.

The node's ranks share MemAvailable and the cgroup (an ordinary launch runs them in one
container or job): each rank's share is the binding room divided by the ranks on the node.
RLIMIT_MEMLOCK is per process and would not be divided.

Where the files are (``HostPaths``) is injectable: the tests fake /proc/meminfo and cgroup
trees.
"""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from ..units import fmt_bytes

MEMLOCK_BINDS_PINNING = False
"""Whether RLIMIT_MEMLOCK bounds the runtime's pinned memory (cudaHostRegister, torch's
pin_memory): no, see the module doc. It does bound mlock and RDMA registration, which the
runtime does not use."""

UNLIMITED_CGROUP = 2**62
"""cgroup v1 writes "no limit" as the largest page-counter value (9223372036854771712 with
4 KiB pages); anything from here up is no limit."""

GUARD_HEADROOM = 256 * 2**20
"""Host bytes a pinning allocation must leave free (at most 1/64 of the node's memory, on a
small machine): page tables, the allocator's rounding and the Python heap growing meanwhile
need some, and reclaim thrashes before the OOM killer acts."""


@dataclass(frozen=True, slots=True)
class HostPaths:
    """Where the limits are read (the system's by default; tests point them at fakes)."""

    meminfo: Path = Path("/proc/meminfo")
    """MemTotal and MemAvailable."""
    proc_cgroup: Path = Path("/proc/self/cgroup")
    """This process's cgroup in each hierarchy (``0::/path`` for v2, ``N:memory:/path`` for v1)."""
    cgroup_v2: Path = Path("/sys/fs/cgroup")
    """Where the unified (v2) hierarchy is mounted."""
    cgroup_v1_memory: Path = Path("/sys/fs/cgroup/memory")
    """Where the v1 memory controller is mounted."""
    proc_status: Path = Path("/proc/self/status")
    """VmLck: bytes this process has locked with mlock (charged to RLIMIT_MEMLOCK)."""


SYSTEM = HostPaths()
"""The paths ``read_host_limits`` reads unless given others."""


@dataclass(frozen=True, slots=True)
class HostLimits:
    """The host memory limits of this process, read once, and this rank's share of them."""

    mem_total: int
    """MemTotal: the node's memory."""
    mem_available: int
    """MemAvailable: what the kernel can give now without swapping (node-wide)."""
    cgroup: str | None
    """The memory cgroup level whose limit leaves the least room (its file, e.g.
    ``/sys/fs/cgroup/job/memory.max``), or None: no cgroup limits memory."""
    cgroup_limit: int | None
    """That level's limit in bytes (None: no limit)."""
    cgroup_used: int
    """That level's working set: usage less the inactive file cache (0 without a limit)."""
    memlock: int | None
    """RLIMIT_MEMLOCK's soft limit in bytes (None: unlimited)."""
    memlock_used: int
    """Bytes this process has locked against it (VmLck)."""
    memlock_binds: bool = MEMLOCK_BINDS_PINNING
    """Whether the memlock room bounds pinning (see ``MEMLOCK_BINDS_PINNING``)."""
    ranks_per_node: int = 1
    """Ranks sharing MemAvailable and the cgroup (``runtime.node``)."""

    def node_rooms(self) -> dict[str, int]:
        """Each limit that bounds pinning, by name, with the room it leaves the node's ranks
        together (RLIMIT_MEMLOCK's, per process, times the ranks: comparable with the others)."""
        rooms = {"MemAvailable": self.mem_available}
        if self.cgroup_limit is not None:
            rooms[f"cgroup {self.cgroup}"] = max(0, self.cgroup_limit - self.cgroup_used)
        if self.memlock_binds and self.memlock is not None:
            rooms["RLIMIT_MEMLOCK"] = max(0, self.memlock - self.memlock_used) * self.ranks_per_node
        return rooms

    @property
    def binding(self) -> str:
        """The name of the limit that leaves the least room."""
        rooms = self.node_rooms()
        return min(rooms, key=rooms.__getitem__)

    @property
    def node_room(self) -> int:
        """Host bytes the node's ranks can still have together."""
        return min(self.node_rooms().values())

    @property
    def share(self) -> int:
        """This rank's host bytes: its share of the binding room."""
        return self.node_room // self.ranks_per_node

    @property
    def headroom(self) -> int:
        """Host bytes ``check_pinning`` keeps free on the node: ``GUARD_HEADROOM``, at most 1/64
        of the node's memory."""
        return min(GUARD_HEADROOM, self.mem_total // 64)

    @property
    def pinnable(self) -> int:
        """The most this rank's plan can pin: its share less its part of ``headroom`` (the node's
        ranks pinning their shares one after the other each pass ``check_pinning``). The
        default host budget and the admission of a plan stay within it, so a plan they take
        is not refused when the runtime pins it."""
        return max(0, self.share - self.headroom // self.ranks_per_node)

    def describe(self) -> str:
        """The limits in one line: each one's room, which binds, this rank's share."""
        parts = [f"MemAvailable {fmt_bytes(self.mem_available)} of {fmt_bytes(self.mem_total)}"]
        if self.cgroup_limit is not None:
            parts.append(f"cgroup {self.cgroup} {fmt_bytes(self.cgroup_limit)} with "
                         f"{fmt_bytes(self.cgroup_used)} in use")
        else:
            parts.append("no cgroup memory limit")
        lock = "unlimited" if self.memlock is None else fmt_bytes(self.memlock)
        parts.append(f"RLIMIT_MEMLOCK {lock}" + ("" if self.memlock_binds else
                                                 " (not binding: CUDA pins without it)"))
        ranks = (f"; this rank's share ({self.ranks_per_node} ranks on the node) "
                 f"{fmt_bytes(self.share)}" if self.ranks_per_node > 1 else "")
        return ", ".join(parts) + f"; {self.binding} binds at {fmt_bytes(self.node_room)}" + ranks


def read_host_limits(paths: HostPaths | None = None, *, ranks_per_node: int = 1,
                     memlock_binds: bool = MEMLOCK_BINDS_PINNING) -> HostLimits:
    """The host memory limits of this process now (``paths``: where to read them, default
    ``SYSTEM``), shared by ``ranks_per_node`` ranks."""
    paths = paths or SYSTEM
    total, available = _meminfo(paths.meminfo)
    cgroup, limit, used = _cgroup_room(paths)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return HostLimits(mem_total=total, mem_available=available, cgroup=cgroup, cgroup_limit=limit,
                      cgroup_used=used, memlock=None if soft == resource.RLIM_INFINITY else int(soft),
                      memlock_used=_status_bytes(paths.proc_status, "VmLck"),
                      memlock_binds=memlock_binds, ranks_per_node=max(1, ranks_per_node))


class PinnedMemoryError(RuntimeError):
    """A pinned host allocation the host cannot give (refused before it is tried, or failed)."""


def check_pinning(nbytes: int, what: str, *, limits: HostLimits | None = None) -> None:
    """Refuse to pin ``nbytes`` of host memory for ``what`` when the host has less room now
    (every limit, less ``GUARD_HEADROOM``): a clear error instead of the OOM killer. The
    node's room, not this rank's share: the plan was checked against the share when it was
    admitted; here the question is whether the machine can give this allocation now."""
    if nbytes <= 0:
        return
    limits = limits or read_host_limits()
    headroom = limits.headroom
    room = limits.node_room - headroom
    if nbytes > room:
        raise PinnedMemoryError(
            f"ProTrain: refusing to pin {fmt_bytes(nbytes)} of host memory for {what}: "
            f"{fmt_bytes(max(0, room))} is left ({limits.describe()}; {fmt_bytes(headroom)} "
            f"is kept free). Free host memory (other processes, "
            f"the data loader's workers), or plan with less: set protrain.host_memory lower, "
            f"or set protrain.ssd_path so optimizer states go to the drive")


def pinning_failed(nbytes: int, what: str, error: BaseException) -> PinnedMemoryError:
    """The allocator's (or the driver's) own failure to give ``nbytes`` for ``what``, named."""
    return PinnedMemoryError(
        f"ProTrain: could not pin {fmt_bytes(nbytes)} of host memory for {what}: "
        f"{str(error).splitlines()[0] if str(error) else type(error).__name__} "
        f"({read_host_limits().describe()}). Set protrain.host_memory lower, or set "
        f"protrain.ssd_path so optimizer states go to the drive")


# ---- readers ---------------------------------------------------------------------------------
def _meminfo(path: Path) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes; without /proc (not Linux): the pages the system
    reports, half of them taken as available."""
    try:
        fields = {}
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024
        return fields["MemTotal"], fields.get("MemAvailable", fields.get("MemFree", 0))
    except (OSError, KeyError, ValueError, IndexError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total // 2


def _status_bytes(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _read_int(path: Path) -> int | None:
    """A cgroup file's number (None: missing, unreadable, ``max`` or v1's no-limit value)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) >= UNLIMITED_CGROUP:
        return None
    return int(text)


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory path) of this process, from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _levels(root: Path, rel: str | None) -> list[Path]:
    """The cgroup directories from this process's up to the mount's root (a path that is not
    under the mount, as in a container without a cgroup namespace: the root alone)."""
    here = root / (rel or "/").lstrip("/")
    if not here.is_dir():
        return [root]
    out = [here]
    while here != root and root in here.parents:
        here = here.parent
        out.append(here)
    return out


def _cgroup_room(paths: HostPaths) -> tuple[str | None, int | None, int]:
    """(the limit file of the level that leaves the least room, its limit, its working set),
    over this process's cgroup and its ancestors; (None, None, 0) where none limits memory.
    v2 where its memory controller is mounted, else v1."""
    v2, v1 = _cgroup_paths(paths.proc_cgroup)
    if v2 is not None and (paths.cgroup_v2 / "cgroup.controllers").exists():
        found = _tightest(_levels(paths.cgroup_v2, v2), "memory.max", "memory.current", "inactive_file")
        if found is not None:
            return found
    if v1 is not None:
        levels = _levels(paths.cgroup_v1_memory, v1)
        found = _tightest(levels, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        # An ancestor above the mount (a container's parent job) shows only in the leaf's
        # hierarchical limit; priced against the leaf's usage (all of it that is visible).
        hier = _stat(levels[0] / "memory.stat", "hierarchical_memory_limit")
        if 0 < hier < UNLIMITED_CGROUP and (found is None or hier < found[1]):
            used = _working_set(levels[0], "memory.usage_in_bytes", "total_inactive_file")
            if found is None or hier - used < found[1] - found[2]:
                found = (str(levels[0] / "memory.stat") + " hierarchical_memory_limit", hier, used)
        if found is not None:
            return found
    return None, None, 0


def _working_set(d: Path, usage: str, inactive: str) -> int:
    """A cgroup level's usage less its inactive file cache (which the kernel reclaims before
    it kills anything)."""
    return max(0, (_read_int(d / usage) or 0) - _stat(d / "memory.stat", inactive))


def _tightest(levels: list[Path], limit_file: str, usage: str, inactive: str):
    """(limit file, limit, working set) of the level leaving the least room, or None."""
    best = None
    for d in levels:
        limit = _read_int(d / limit_file)
        if limit is None:
            continue
        used = _working_set(d, usage, inactive)
        if best is None or limit - used < best[1] - best[2]:
            best = (str(d / limit_file), limit, used)
    return best

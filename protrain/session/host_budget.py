"""This rank's host budget: what the plans are searched under, and the check a plan passes
before any rank builds it.

The budget a search gets is this rank's share of what the host can give (``runtime.host_limits``:
MemAvailable and the memory cgroup, divided among the node's ranks), less
``PlannerConfig.host_reserve`` for the data loader, the OS and the framework.
``protrain.host_memory`` replaces it with the node's host memory, as ``protrain plan
--host-memory`` and the plan's machine line give it: each rank plans for 1/ranks_per_node of
it (``cost.host_share.host_memory_share``). The machine the search gets carries the node's
figure too (this rank's budget times the node's ranks). With ``ssd_path`` set the search then
moves optimizer states to the drive (``Knobs.n_nvme``) rather than past the budget.

A plan, searched or loaded from a plan file, is admitted by the deciding rank:

- it needs more than the rank's share: refused, naming what it needs, what each limit allows,
  which one binds, and the fixes (a plan made under a larger ``host_memory``, or on another
  machine, would otherwise be killed while pinning: DeepSpeed issues 4571, 5290, 2918, 4380);
- it leaves less than the reserve: admitted with a warning at start-up ("at least a warning").
"""
from __future__ import annotations

from dataclasses import replace

from ..config import PlannerConfig
from ..plan import Plan
from ..profile.hardware import HardwareProfile
from ..runtime.host_limits import HostLimits
from ..search import InfeasibleError
from ..units import fmt_bytes


def default_budget(limits: HostLimits, reserve: float) -> int:
    """The host bytes a search may plan for on this rank when ``host_memory`` is not set: its
    share of the binding limit, less ``reserve`` of it, and at most what it can pin
    (``HostLimits.pinnable``: on a small host the pinning guard keeps more free than the
    reserve, and a plan inside the budget must not be refused when the runtime pins it)."""
    return min(int(limits.share * (1.0 - reserve)), limits.pinnable)


def with_host_budget(hw: HardwareProfile, limits: HostLimits, planner: PlannerConfig) -> HardwareProfile:
    """``hw`` with the node's default host budget: this rank's times the ranks ``hw`` shares
    its host with, so that the search's share of it is this rank's budget exactly (the search
    replaces it with ``planner.host_memory``, the node's, where that is set)."""
    return replace(hw, host_memory=default_budget(limits, planner.host_reserve) * max(1, hw.ranks_per_node))


def rank_budget(planner: PlannerConfig, limits: HostLimits) -> int | None:
    """This rank's part of ``protrain.host_memory`` (the node's), or None where it is not set."""
    if planner.host_memory is None:
        return None
    return planner.host_memory // max(1, limits.ranks_per_node)


def describe_budget(limits: HostLimits, planner: PlannerConfig) -> str:
    """Where the host budget comes from, in one line: the node's figure and this rank's share
    where several ranks share the node."""
    rpn = max(1, limits.ranks_per_node)
    if planner.host_memory is not None:
        each = (f": {fmt_bytes(rank_budget(planner, limits))} for each of the node's {rpn} ranks"
                if rpn > 1 else "")
        return (f"host budget {fmt_bytes(planner.host_memory)} for the node (protrain.host_memory)"
                f"{each}; this rank can have {fmt_bytes(limits.share)}: {limits.describe()}")
    budget = default_budget(limits, planner.host_reserve)
    kept = (f"the {planner.host_reserve:.0%} host_reserve" if budget < limits.pinnable else
            f"the {fmt_bytes(limits.share - budget)} the pinning guard keeps free (more than the "
            f"{planner.host_reserve:.0%} host_reserve)")
    node = f" per rank ({fmt_bytes(budget * rpn)} for the node's {rpn} ranks)" if rpn > 1 else ""
    return (f"host budget {fmt_bytes(budget)}{node}: this rank's {fmt_bytes(limits.share)} "
            f"less {kept}; {limits.describe()}")


def admit(plan: Plan, limits: HostLimits, planner: PlannerConfig, *,
          ssd_path: str | None) -> str | None:
    """Refuse ``plan`` (an ``InfeasibleError``, which the adapters word on every rank) when it
    needs more host memory than this rank can have; a warning to print when it leaves less
    than the reserve; None when it fits."""
    need = plan.prediction.host_bytes
    share = limits.share
    if need > limits.pinnable:
        kept = (f" less the {fmt_bytes(share - limits.pinnable)} the pinning guard keeps free: "
                f"{fmt_bytes(limits.pinnable)}" if limits.pinnable < share else "")
        raise InfeasibleError(
            f"this rank's host memory cannot hold the plan: it needs {fmt_bytes(need)} "
            f"(offloaded chunks' states and buffers {fmt_bytes(need - plan.prediction.swap_host_bytes)}, "
            f"swapped activations {fmt_bytes(plan.prediction.swap_host_bytes)}) and this rank can "
            f"have {fmt_bytes(share)}{kept}: {limits.describe()}. "
            + _fixes(plan, limits, planner, ssd_path=ssd_path), host_needed=need)
    left = share - need
    if left < share * planner.host_reserve:
        return (f"ProTrain: warning: the plan pins {fmt_bytes(need)} of host memory and leaves "
                f"{fmt_bytes(left)} of this rank's {fmt_bytes(share)} (less than the "
                f"{planner.host_reserve:.0%} host_reserve) for the data loader, the OS and the "
                f"framework: if they need more, the OOM killer stops the run. {limits.describe()}. "
                + _fixes(plan, limits, planner, ssd_path=ssd_path))
    return None


def _fixes(plan: Plan, limits: HostLimits, planner: PlannerConfig, *, ssd_path: str | None) -> str:
    """What would make the plan fit, most direct first."""
    budget = default_budget(limits, planner.host_reserve)
    rpn = max(1, limits.ranks_per_node)
    fixes = []
    if planner.host_memory is not None and rank_budget(planner, limits) > budget:
        it = (f"the node's host memory, {fmt_bytes(budget)} for each of its {rpn} ranks; it is "
              f"{fmt_bytes(planner.host_memory)}, {fmt_bytes(rank_budget(planner, limits))} each"
              if rpn > 1 else f"it is {fmt_bytes(planner.host_memory)}")
        fixes.append(f"set protrain.host_memory to at most {fmt_bytes(budget * rpn)} ({it}), or "
                     f"remove it: the default is this budget")
    elif plan.host_memory > budget:
        fixes.append(f"plan again (the plan was made for {fmt_bytes(plan.host_memory)} of host "
                     f"memory per rank; delete the plan file, the default budget here is "
                     f"{fmt_bytes(budget)} per rank)")
    # Only knobs the user pinned are worth unpinning: the planner fits the others already.
    if planner.speculate_chunks is not None and plan.n_speculate:
        fixes.append(f"pin speculate_chunks lower or leave it on auto (it is {planner.speculate_chunks}: "
                     f"each speculating chunk keeps a backup of its states in host memory)")
    if not ssd_path:
        fixes.append("set protrain.ssd_path to an NVMe directory so optimizer states go to the drive")
    elif planner.pins.n_nvme is not None:
        fixes.append(f"let the planner put more optimizer states on the drive (unpin n_nvme, "
                     f"pinned to {planner.pins.n_nvme})")
    fixes.append("spread the run over more nodes (the offloaded states are sharded over the "
                 "data-parallel ranks, and the ranks of a node share its memory)")
    if limits.binding.startswith("cgroup"):
        fixes.append("raise the container's or job's memory limit")
    return "Fix: " + "; or ".join(fixes)

"""The ranks that run one plan, the rank among them that decides it, and how the decision
reaches the others: the plan, or the error the decider met, worded the same on every rank.

One rank decides and the others wait in a broadcast for what it decided. Whatever the
decider meets - no plan fits, a bad plan file, a bug - is sent in that broadcast too, so no
rank goes on to wait in a collective for a peer that stopped: every rank raises.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..plan import Plan
from ..runtime.collectives import DataParallel
from ..search import InfeasibleError


@dataclass(frozen=True, slots=True)
class PlanRanks:
    """A group of ranks that must run the same plan, and its decider."""

    dp: DataParallel
    """The ranks (world 1: this rank alone)."""
    decider: int = 0
    """Global rank of the rank that profiles the model's plan and searches it for the group."""

    @property
    def decides(self) -> bool:
        """Whether this rank decides for its group."""
        return self.dp.world == 1 or dist.get_rank() == self.decider

    def share(self, obj):
        """The decider's ``obj`` on every rank of the group (every rank must call it)."""
        return self.dp.broadcast_object(obj, src=self.decider)

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` is set on any rank of the group (every rank must call it)."""
        if self.dp.world == 1:
            return flag
        dev = device if dist.get_backend(self.dp.group) == "nccl" else torch.device("cpu")
        t = torch.tensor([float(flag)], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp.group)
        return bool(t.item() > 0)


@dataclass(frozen=True, slots=True)
class PlanFailure:
    """The error the decider met while deciding, as every rank of its group receives it."""

    kind: str
    """The exception's type name (``InfeasibleError``, ``ConfigError``, ...)."""
    message: str
    own: BaseException | None = None
    """The exception itself, on the decider only (its traceback and type)."""
    device_needed: int | None = None
    """``InfeasibleError``'s device bytes the smallest plan needs (None: not given)."""
    host_needed: int | None = None
    """``InfeasibleError``'s host bytes the smallest plan needs (None: not given)."""
    micro_batch_fit: int | None = None
    """``InfeasibleError``'s largest micro-batch that would fit (None: not given)."""

    @classmethod
    def of(cls, e: BaseException) -> "PlanFailure":
        return cls(type(e).__name__, str(e), e, getattr(e, "device_needed", None),
                   getattr(e, "host_needed", None), getattr(e, "micro_batch_fit", None))

    def sendable(self) -> tuple:
        """What the broadcast carries (everything but the exception itself)."""
        return (self.kind, self.message, self.device_needed, self.host_needed, self.micro_batch_fit)

    def infeasible(self, message: str) -> InfeasibleError:
        """An ``InfeasibleError`` saying ``message``, with the decider's figures of what fits."""
        return InfeasibleError(message, device_needed=self.device_needed, host_needed=self.host_needed,
                               micro_batch_fit=self.micro_batch_fit)


Wording = Callable[[PlanFailure], BaseException]
"""How an adapter words the decider's error on every rank (its keys, its flags)."""


def share_decision(ranks: PlanRanks, plan: Plan | None, extra, failure: BaseException | None,
                   word: Wording) -> tuple[Plan | None, object]:
    """The decider's ``plan`` and ``extra`` (a small picklable value) on every rank of
    ``ranks``, or on every rank the exception ``word`` makes of its ``failure`` (a collective)."""
    mine = PlanFailure.of(failure) if failure is not None else None
    d, extra, sent = ranks.share((plan.to_dict() if plan is not None else None, extra,
                                  mine.sendable() if mine is not None else None))
    if sent is not None:
        error = word(mine if mine is not None else PlanFailure(*sent[:2], None, *sent[2:]))
        if error is failure:
            raise error                  # the decider's own: its traceback and all
        raise error from None
    if ranks.decides or d is None:
        return plan, extra
    return Plan.from_dict(d), extra

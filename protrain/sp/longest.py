"""The longest sequence a model trains at on a machine: a search over sequence lengths around
the planner (``protrain plan --seq max``).

Each length tried is planned by the real search (with P pinned, per sequence-parallel degree),
so the length found comes with a real plan, and the next length up (one granule more,
``degree.seq_step``: 128 x P tokens) was planned too and did not fit. Lengths are searched per
degree in that degree's granule - the lengths P divides - and the longest over the degrees wins.
A degree with no fitting length that is a multiple of 128 x P is shorter than the winner at
every multiple of 128 past it, so the winner is the longest multiple of 128 some degree plans.

The search assumes what the memory model says: a longer sequence never needs less memory. It
gallops from a start length (doubling or halving) until one length fits and one does not, then
narrows the bracket. A length that does not fit the device says where its activations would
(``InfeasibleError.seq_len_fit``, linear in the tokens), and that estimate is tried first: on
the analytic profiles it is usually the answer, found in a handful of plans; bisection takes
over when it is not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..cost.host_share import host_memory_share
from ..plan import Plan
from ..profile.hardware import HardwareProfile
from ..search import InfeasibleError
from ..units import fmt_bytes
from .degree import seq_step

LONGEST_SEARCHED = 1 << 25
"""Where the search over lengths stops (32 Mi tokens): a plan still fitting there is returned
with that length, not searched further."""

_GUESSES = 3
"""Estimates tried per degree before plain bisection: enough to land on the answer when the
estimate is right to a granule, few enough that a biased one cannot make the search linear."""


@dataclass(frozen=True, slots=True)
class Longest:
    """The longest sequence one degree plans, and why the next length does not."""

    degree: int
    """The sequence-parallel degree P it was planned with (1 without sequence parallelism)."""
    step: int
    """The granule searched: every length tried is a multiple of it (128 x P)."""
    seq_len: int
    """The longest length that plans (0: not even ``step`` tokens do)."""
    plan: Plan | None
    """The plan at ``seq_len`` (None where nothing fits)."""
    next_error: InfeasibleError | None
    """Why ``seq_len + step`` does not plan (None: the search stopped at ``limit`` with a plan)."""
    limit: int
    """The longest length considered (the model's position table, else ``LONGEST_SEARCHED``)."""
    plans_searched: int
    """How many lengths were planned to find it."""


def longest_sequence(plan_at: Callable[[int], Plan], step: int, *, start: int, degree: int = 1,
                     limit: int | None = None) -> Longest:
    """The longest multiple of ``step`` tokens, up to ``limit``, at which ``plan_at`` (the
    planner at that length; raises ``InfeasibleError`` where nothing fits) returns a plan.
    ``start``: the first length tried (rounded to ``step``; the closer, the fewer plans)."""
    top = min(limit or LONGEST_SEARCHED, LONGEST_SEARCHED) // step * step
    lo, hi = 0, None                       # lo plans (0: none known), hi does not (None: none known)
    plan = error = None
    guesses, tried, guessed = _GUESSES, 0, False
    x = min(max(start // step * step, step), top) if top else 0
    while x:
        tried += 1
        try:
            plan, lo = plan_at(x), x
            guess = lo + step if guessed else None          # check the estimate's neighbour next
        except InfeasibleError as e:
            error, hi = e, x
            guess = e.seq_len_fit // step * step if e.seq_len_fit is not None else None
        x, guessed = _next_length(lo, hi, step, top, guess if guesses else None)
        guesses -= guessed
    return Longest(degree=degree, step=step, seq_len=lo, plan=plan if lo else None,
                   next_error=error if hi is not None else None, limit=top, plans_searched=tried)


def longest_over_degrees(plan_at: Callable[[int, int], Plan], degrees, *, start: int,
                         limit: int | None = None) -> tuple[list[Longest], Longest]:
    """Each degree's longest sequence (``plan_at(seq, P)``: the planner at that length with P
    pinned), in its own granule, and the longest of them (the smaller P on a tie). Each degree
    starts where the one before ended, scaled by P: a rank of P holds 1/P of the activations."""
    found: list[Longest] = []
    at, prev = start, 1
    for p in degrees:
        f = longest_sequence(lambda seq, p=p: plan_at(seq, p), seq_step(p), start=at * p // prev,
                             degree=p, limit=limit)
        found.append(f)
        if f.seq_len:
            at, prev = f.seq_len, p
    return found, max(found, key=lambda f: (f.seq_len, -f.degree))


def _next_length(lo: int, hi: int | None, step: int, top: int, guess: int | None) -> tuple[int, bool]:
    """The next length to plan (0: done) and whether it is an estimate's: a guess strictly
    inside the bracket, else a gallop (doubling from ``lo`` while nothing fails, halving from
    ``hi`` while nothing fits), else the bracket's middle."""
    if hi is None:
        return (min(2 * lo, top), False) if lo < top else (0, False)
    if hi - lo <= step:
        return 0, False
    if guess is not None and lo < guess < hi:
        return guess, True
    if lo == 0:
        return max(hi // 2 // step * step, step), False
    return (lo + hi) // 2 // step * step, False


def binding(error: InfeasibleError, hw: HardwareProfile) -> str:
    """What rules out a length, in a few words: the memory it needs against what there is
    (``hw`` with the plan's limits: ``HardwareProfile.with_limits``)."""
    if error.device_needed and error.device_needed > hw.device_memory:
        return (f"device memory binds (the leanest plan needs {fmt_bytes(error.device_needed)} with "
                f"the margin, {fmt_bytes(error.device_needed - hw.device_memory)} more than the "
                f"{fmt_bytes(hw.device_memory)} there is)")
    share = host_memory_share(hw)
    if error.host_needed and error.host_needed > share:
        rpn = max(1, hw.ranks_per_node)
        each = (f" per rank, {fmt_bytes(error.host_needed - share)} more than the {fmt_bytes(share)} "
                f"each of the node's {rpn} ranks has of its {fmt_bytes(hw.host_memory)}" if rpn > 1 else
                f", {fmt_bytes(error.host_needed - share)} more than the {fmt_bytes(share)} there is")
        return f"host memory binds (the plan needs {fmt_bytes(error.host_needed)}{each})"
    return str(error).split(". ")[0]


def describe(found: list[Longest], best: Longest, hw: HardwareProfile) -> str:
    """The line ``protrain plan --seq max`` prints under the plan: the longest length, each
    degree's where there are several, and what binds one granule further."""
    n = sum(f.plans_searched for f in found)
    per = (" (" + ", ".join(f"P={f.degree}: {f.seq_len}" for f in found) + ")" if len(found) > 1 else "")
    grid = "multiples of 128 x P" if len(found) > 1 or best.degree > 1 else "multiples of 128"
    line = (f"  longest sequence: {best.seq_len} tokens" + (f" with P={best.degree}" if len(found) > 1 else "")
            + f"{per}; {grid} searched, {n} length{'s' if n > 1 else ''} planned")
    if best.next_error is None:
        return line + (f"; the search stops at {best.limit} tokens" if best.limit > LONGEST_SEARCHED - best.step else
                       f"; {best.limit} tokens is the model's position table")
    return line + f"; at {best.seq_len + best.step}" + (f" (P={best.degree})" if len(found) > 1 else "") \
        + f": {binding(best.next_error, hw)}"

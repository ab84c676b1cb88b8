"""PlanningSession: how the plan every rank of a group runs is decided, and decided again.

The decider loads the plan file, or profiles the model, probes the machine, searches and saves
the plan there; every rank of the group gets the plan or the same error (ranks.py). An adapter
says how each step is done for its framework (``PlanningSteps``); the session runs them in
order, holds what was measured, and plans again for a training loop's two surprises:

- an out-of-memory error (one rank): plan again with a 10-point larger memory margin;
- a batch beyond the shape the plan covers (more samples or tokens): plan for it, rounded up
  (batch_shape.replan_shape), from the profile taken at the first batch and rescaled
  (protrain.sp.scaling).

The adapter moves the training state into the new plan's runtime; the session only decides.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..batch_shape import BatchShape, replan_shape
from ..config import PlannerConfig
from ..plan import Plan
from ..profile.hardware import HardwareProfile
from ..profile.model_profile import ModelProfile
from ..runtime.host_limits import HostLimits
from ..search import InfeasibleError, search
from ..units import fmt_bytes
from .host_budget import admit, describe_budget, with_host_budget
from .ranks import PlanRanks, Wording, share_decision


NO_SEQUENCE = ("the batch has no sequence dimension (no input_ids or inputs_embeds, no integer "
               "(batch, tokens) tensor): its samples cannot be split over the ranks")
"""Why sequence parallelism is off for a batch of features or images (batch_shape.batch_dims)."""


@dataclass(frozen=True, slots=True)
class PlanningSteps:
    """How an adapter does each step of deciding a plan."""

    load: Callable[[PlannerConfig, BatchShape | None], Plan | None]
    """The decider: the plan file's plan, if it was made for this run and covers batches up to
    the shape; None: plan it (an unusable file raises, saying why)."""
    measure: Callable[[object], ModelProfile]
    """Profile the model on the batch given to ``decide`` (once per session; on the decider,
    or every rank: ``measured_together``)."""
    machine: Callable[[], HardwareProfile]
    """The decider: the machine to plan for (asked once per session)."""
    search: Callable[[ModelProfile, HardwareProfile, PlannerConfig, BatchShape | None], Plan]
    """The decider: the plan for the profile and batches up to the shape."""
    word: Wording
    """How the decider's error is worded on every rank."""
    measured_together: bool = False
    """Every rank of the group profiles (tensor-parallel ranks run the forward together)."""
    together: Callable[[], None] | None = None
    """What every rank measures together before each decision (the links between them)."""
    host: Callable[[], HostLimits] | None = None
    """The decider: this process's host memory limits, shared by its node's ranks (asked once
    per session, before any runtime holds host memory). They give the search its default host
    budget and admit each plan (host_budget.py). None: the machine's ``host_memory`` is the
    budget, and plans are not checked."""
    ssd_path: str | None = None
    """Where optimizer states may go: named in the fixes of a plan refused for host memory."""
    drive_free: Callable[[], int] | None = None
    """The decider: the free bytes under ``ssd_path`` now, the plans' ``nvme_free_bytes``. The
    machine is measured once per session, but the drive is asked again at every decision: a
    re-plan's runtime is built while the old runtime's state file is still on it (and other
    jobs write there meanwhile). None: the machine's figure."""


@dataclass(frozen=True, slots=True)
class Decision:
    """A plan decided for a group of ranks."""

    plan: Plan
    loaded: bool
    """Read from the plan file (no profiling or search)."""
    profile_seconds: float
    """Spent profiling for it (0: the profile was held, given, or not needed)."""


class PlanningSession:
    """One model's planning over a run: the first plan, and the plans made again."""

    def __init__(self, ranks: PlanRanks, steps: PlanningSteps, *, plan_file: str | None,
                 profile: ModelProfile | None = None):
        self.ranks = ranks
        self.steps = steps
        self.plan_file = plan_file
        """Where the decider loads the plan from and saves the plans it makes."""
        self.profile = profile
        """The measured profile, held for re-plans (None: not measured, or a loaded plan)."""
        self.margin = 0.0
        """The memory margin the out-of-memory re-plans reached (0: none yet)."""
        self._machine: HardwareProfile | None = None
        self._host: HostLimits | None = None

    def machine(self) -> HardwareProfile:
        """The decider: the hardware the plans are made for (measured once per session)."""
        if self._machine is None:
            self._machine = self.steps.machine()
        return self._machine

    def host(self) -> HostLimits | None:
        """The decider: the host memory limits the plans are made for and admitted against
        (read once per session: a re-plan's runtime is built while the old one's states are
        still held, which the limits read then would count against it)."""
        if self._host is None and self.steps.host is not None:
            self._host = self.steps.host()
        return self._host

    def _priced(self, planner: PlannerConfig, drive_held: int = 0) -> HardwareProfile:
        """The machine with this rank's host budget (host_budget.with_host_budget) and the
        drive's free space now (``drive_held``: of the space not free, what this rank's old
        state file holds until a re-plan has moved its states)."""
        limits = self.host()
        hw = self.machine()
        if self.steps.drive_free is not None:
            hw = replace(hw, nvme_free_bytes=self.steps.drive_free(), nvme_held_bytes=drive_held)
        return hw if limits is None else with_host_budget(hw, limits, planner)

    def _admit(self, plan: Plan, planner: PlannerConfig) -> None:
        """Refuse a plan this rank's host memory cannot hold; warn when it leaves less than
        the reserve (host_budget.admit)."""
        limits = self.host()
        if limits is not None:
            warning = admit(plan, limits, planner, ssd_path=self.steps.ssd_path)
            if warning:
                print(warning, flush=True)

    def _with_budget(self, error: Exception, planner: PlannerConfig) -> Exception:
        """A search's ``InfeasibleError`` with where the host budget it was given comes from."""
        limits = self.host()
        if type(error) is not InfeasibleError or limits is None:
            return error
        return InfeasibleError(f"{error} ({describe_budget(limits, planner)})",
                               device_needed=error.device_needed, host_needed=error.host_needed,
                               micro_batch_fit=error.micro_batch_fit)

    def decide(self, planner: PlannerConfig, target: BatchShape | None, *, load: bool = True,
               batch=None, save: bool = True, drive_held: int = 0) -> Decision:
        """The plan every rank of the group runs for batches up to ``target``: the decider
        loads it from the plan file (with ``load``) or searches it from the profile (measured
        now on ``batch`` if none is held) and saves it there (with ``save``); every rank gets
        it or the same error (a collective). ``drive_held``: bytes of the drive this rank's
        old state file holds until the new plan's runtime has its states (``_priced``)."""
        steps = self.steps
        if steps.together is not None:
            steps.together()
        t0 = time.perf_counter()
        profile_seconds = 0.0
        plan, failure = None, None
        if self.ranks.decides and load:
            try:
                plan = steps.load(planner, target)
                if plan is not None:
                    self._admit(plan, planner)
            except Exception as e:  # noqa: BLE001 - the peers wait in the broadcast below
                failure = e
        loaded = plan is not None
        if steps.measured_together:
            # Whether the group profiles, or stops: the decider's verdict on its plan file.
            _, loaded = share_decision(self.ranks, None, loaded, failure, steps.word)
            if not loaded and self.profile is None:
                self.profile = steps.measure(batch)
                profile_seconds = time.perf_counter() - t0
        if self.ranks.decides and not loaded and failure is None:
            # One rank measures and decides; every rank runs the same plan.
            try:
                if self.profile is None:
                    self.profile = steps.measure(batch)
                    profile_seconds = time.perf_counter() - t0
                plan = steps.search(self.profile, self._priced(planner, drive_held), planner, target)
                self._admit(plan, planner)
                if self.plan_file and save:
                    plan.save(self.plan_file)
            except Exception as e:  # noqa: BLE001 - the peers wait in the broadcast below
                failure = self._with_budget(e, planner)
        plan, loaded = share_decision(self.ranks, plan, loaded, failure, steps.word)
        return Decision(plan, loaded, profile_seconds)

    def first_plan(self, planner: PlannerConfig, shape: BatchShape | None, target: BatchShape | None,
                   *, verbosity: int, probe: Callable[[], object], batch=None) -> Plan:
        """The plan for the first batch (``shape``) and batches up to ``target``, printed.
        ``probe()``: the node's probe, which every rank takes part in when the decider will
        plan (one process per node measures while the node's others sleep on the probe's lock;
        waiting in the plan's broadcast instead, NCCL ranks would spin a core each under the
        measurement)."""
        if self.ranks.dp.world > 1 and not (self.plan_file and Path(self.plan_file).exists()):
            probe()
        decision = self.decide(planner, target, load=True, batch=batch)
        plan = decision.plan
        if self.ranks.decides and verbosity >= 1:
            print(plan.explain(), flush=True)
            if self.host() is not None:
                print(f"ProTrain: {describe_budget(self.host(), planner)}", flush=True)
            if decision.loaded:
                print(f"ProTrain: plan loaded from {self.plan_file} (no profiling or search)", flush=True)
            else:
                beyond = f"; planned for batches up to {target}" if target != shape else ""
                print(f"ProTrain: profiling took {decision.profile_seconds:.2f} s, search "
                      f"{plan.search_seconds:.3f} s{beyond}" + (f"; plan saved to {self.plan_file}"
                                                               if self.plan_file else ""), flush=True)
        elif self.ranks.decides and verbosity == 0:
            k = plan.knobs
            sp = f", sequence_parallel={k.sequence_parallel}" if k.sequence_parallel > 1 else ""
            print(f"ProTrain: plan {k.as_tuple()}{sp} predicted {plan.prediction.iter_time:.3f} s/iter, "
                  f"peak {plan.prediction.peak_device_bytes / 2**30:.2f} GiB", flush=True)
        return plan

    # ---- planning again ----------------------------------------------------------------------
    def replan(self, planner: PlannerConfig, target: BatchShape | None, *, old: Plan,
               keep_grads: bool, batch=None, remeasure: bool = False, drive_held: int = 0) -> Plan:
        """The plan for batches up to ``target`` with ``planner`` (its margin the re-plan's),
        made now from the held profile (or one of ``batch``: after a loaded plan; a
        collective). ``keep_grads``: the gradients accumulated under ``old`` are carried into
        the new plan. ``remeasure``: the model changed what it trains (requires_grad), so the
        held profile is of another parameter set: profile ``batch`` again; the plan is not
        saved to the plan file, which keeps the plan the run starts with. ``drive_held``: bytes
        of the drive the old runtime's state file holds until the new runtime has its states."""
        if remeasure:
            self.profile = None
        if keep_grads and self.ranks.dp.world > 1 and old.knobs.sequence_parallel == 1 and \
                planner.pins.sequence_parallel is None:
            # A plan at P > 1 learns the script's loss factor (sequence_parallel.py) on its
            # first micro-step by rescaling what was accumulated, which would rescale the
            # gradients carried over from P = 1 too: the degree stays for this re-plan.
            planner = replace(planner, pins=replace(planner.pins, sequence_parallel=1))
        return self.decide(planner, target, load=False, batch=batch, save=not remeasure,
                           drive_held=drive_held).plan

    def margin_after_oom(self, configured: float, error: BaseException) -> float:
        """The memory margin to plan again with after an out-of-memory error on this rank:
        10 points above the last; refused with several ranks (the others are inside a
        collective) and once no margin is left."""
        if self.ranks.dp.world > 1:
            raise RuntimeError("ProTrain: out of device memory with several ranks: re-planning "
                               "needs every rank; restart from the last checkpoint with a larger "
                               "protrain.memory_margin") from error
        margin = max(configured, self.margin) + 0.1
        if margin >= 1.0:
            raise InfeasibleError(f"ProTrain: out of device memory again at a {margin - 0.1:.0%} "
                                  f"margin; no plan is safe on this device. Lower the micro-batch "
                                  f"or the sequence length, or use a device with more memory") from error
        self.margin = margin
        return margin

    def say_out_of_memory(self, where: str, error: BaseException, old: Plan, plan: Plan) -> None:
        """The decider: the re-plan after an out-of-memory error in ``where``, from ``old`` to ``plan``."""
        if self.ranks.decides:
            print(f"ProTrain: out of device memory in {where} ({str(error).splitlines()[0][:120]}); "
                  f"re-planned with a {self.margin:.0%} margin: {old.knobs.as_tuple()} -> "
                  f"{plan.knobs.as_tuple()}, predicted peak {plan.prediction.peak_device_bytes / 2**30:.2f} "
                  f"GiB; redoing the micro-batch", flush=True)

    def say_trainable_changed(self, what: str, n_trainable: int, old: Plan, plan: Plan) -> None:
        """The decider: the re-plan after ``requires_grad`` changed (``what``)."""
        if self.ranks.decides:
            print(f"ProTrain: requires_grad changed ({what}); re-planned for the {n_trainable} "
                  f"trainable parameters: {old.knobs.as_tuple()} -> {plan.knobs.as_tuple()}, "
                  f"predicted peak {fmt_bytes(plan.prediction.peak_device_bytes)}", flush=True)

    def say_accumulation_by_hand(self, old: Plan, plan: Plan) -> None:
        """The decider: the re-plan for a script accumulating gradients by hand with the
        steps at 1 (protrain_ds/accumulation.py), from ``old`` to ``plan``."""
        if self.ranks.decides:
            print(f"ProTrain: gradients accumulate by hand (engine.no_sync() or a micro-batch that "
                  f"is not a boundary, with gradient_accumulation_steps 1); re-planned with "
                  f"gradient accumulators: {old.knobs.as_tuple()} -> {plan.knobs.as_tuple()}, "
                  f"predicted peak {fmt_bytes(plan.prediction.peak_device_bytes)}", flush=True)

    def say_longer_batch(self, shape: BatchShape, covered: BatchShape, target: BatchShape,
                         old: Plan, plan: Plan, *, world: int) -> None:
        """The decider: the re-plan for a batch of ``shape`` beyond ``covered`` (the largest
        over ``world`` ranks), from ``old`` to ``plan`` for batches up to ``target``."""
        if self.ranks.decides:
            ranks = f" (the largest of {world} ranks')" if world > 1 else ""
            p0, p1 = old.knobs.sequence_parallel, plan.knobs.sequence_parallel
            sp = f", sequence_parallel {p0} -> {p1}" if p1 != p0 else ""
            print(f"ProTrain: batch {shape}{ranks} is beyond the plan's {covered}; re-planned for "
                  f"{target}: {old.knobs.as_tuple()} -> {plan.knobs.as_tuple()}{sp}, predicted peak "
                  f"{fmt_bytes(plan.prediction.peak_device_bytes)}"
                  + (f"; saved to {self.plan_file}" if self.plan_file else ""), flush=True)


def first_target(shape: BatchShape | None, micro_batch: int, longest: int | None) -> BatchShape | None:
    """What the first plan covers: the first batch, the configured micro-batch, and the
    longest sequence when given (then longer batches never re-plan); a batch without a sequence,
    the micro-batches alone."""
    if shape is None:
        return None
    return shape.union(BatchShape(micro_batch, longest if shape.seq_len else None))


def longer_target(shape: BatchShape, covered: BatchShape, *, micro_batch: int,
                  model_max: int | None) -> BatchShape:
    """What to plan for when a batch of ``shape`` goes beyond ``covered``: rounded up
    (batch_shape.replan_shape) so that growing lengths re-plan a handful of times."""
    return replan_shape(shape, micro_batch=micro_batch, model_max=model_max).union(covered)


def search_for_batches(profile: ModelProfile, hw: HardwareProfile, planner: PlannerConfig,
                       target: BatchShape | None, *, world: int, second: ModelProfile | None,
                       unsupported: str | None) -> Plan:
    """The plan for batches up to ``target`` from ``profile`` (scaled to ``target`` when it
    was taken at another shape, and per sequence-parallel degree over ``world`` ranks;
    ``second``: the profile at a shorter sequence; ``unsupported``: why the model cannot be
    split over the sequence, None if it can)."""
    if target is None or (world == 1 and (target.micro_batch, target.seq_len) ==
                          (profile.micro_batch, profile.seq_len)):
        return search(profile, hw, planner)
    if target.seq_len is None or profile.seq_len is None:
        unsupported = NO_SEQUENCE
    from ..sp.planner import search_sequence_parallel
    return search_sequence_parallel(profile, hw, planner, seq_len=target.seq_len,
                                    micro_batch=target.micro_batch, unsupported=unsupported,
                                    second=second)

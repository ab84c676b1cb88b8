"""plan_activations: one call from a built megatron-core model to an applied activation plan.

Profile (one traced iteration of the real model on a sample batch, or a given profile) ->
search (activation modes only: Megatron keeps its model states, a fixed part of the peak) ->
prefer Megatron's native recompute when it is as good -> apply (``ActivationPolicy``).
With torch.distributed initialised, the first rank of each tensor x context parallel group
decides and every rank of the group applies its plan: those ranks must recompute the same
layers, or their collectives inside the layers would not match. Pipeline stages and
data-parallel replicas plan for themselves (each stage has its own layers and micro-batches
in flight).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from protrain.block_mode import BlockMode, modes_string
from protrain.config import KnobPins, PlannerConfig
from protrain.plan import Plan
from protrain.profile.hardware import HardwareProfile
from protrain.profile.model_profile import ModelProfile
from protrain.profile.transforms import scale_figures
from protrain.runtime.collectives import DataParallel
from protrain.runtime.host_limits import read_host_limits
from protrain.search import InfeasibleError, evaluate, search
from protrain.session import PlanFailure, PlanningSession, PlanningSteps, PlanRanks
from protrain.units import fmt_bytes, fmt_seconds

from .model import decoder_layers, model_device, parallel_sizes, unwrap
from .policy import ActivationPolicy, native_only_reason, native_recompute_layers
from .state_bytes import MegatronStates

log = logging.getLogger("protrain")

Sample = Mapping[str, torch.Tensor] | Callable[[nn.Module], torch.Tensor]
"""A batch for ``GPTModel.forward`` (input_ids, position_ids, attention_mask, labels), or a
function that runs the model's forward on a batch and returns the scalar loss."""

ACTIVATION_KNOBS = ("n_checkpoint", "n_swap", "n_ssd", "n_selective")


@dataclass
class AppliedPlan:
    """A plan running on a model: what was chosen, how it was applied, what it predicts."""

    plan: Plan
    policy: ActivationPolicy
    states: MegatronStates
    profile: ModelProfile | None
    profile_seconds: float = 0.0

    def close(self) -> None:
        self.policy.close()

    def explain(self) -> str:
        p = self.plan.prediction
        table = self.policy.layer_table()
        runs = []
        for number, mode in table:          # "1-4 ckpt, 5-6 swap, 7-24 keep" by global number
            if runs and runs[-1][2] == mode and runs[-1][1] == number - 1:
                runs[-1][1] = number
            else:
                runs.append([number, number, mode])
        word = {BlockMode.NONE: "keep", BlockMode.CKPT: "recompute", BlockMode.SWAP: "swap to host",
                BlockMode.SSD: "NVMe", BlockMode.SELECTIVE: "selective recompute"}
        layers = ", ".join(f"{a}{'-' + str(b) if b != a else ''} {word[m]}" for a, b, m in runs)
        k = self.plan.knobs
        out = [f"ProTrain activation plan for {self.plan.model} ({len(table)} layers on this rank)",
               f"  machine: {self.plan.machine}",
               f"  layers (global numbers): {layers}",
               f"  modes: {modes_string(self.plan.block_modes)} = {k.n_checkpoint} recomputed, "
               f"{k.n_selective} selectively recomputed, {k.n_swap} swapped, {k.n_ssd} on NVMe",
               f"  applied through {self.policy.how}",
               "  replaces --recompute-granularity/-method/-num-layers, --cpu-offloading(-num-layers)",
               f"  predicted: iteration {fmt_seconds(p.iter_time)} (forward {fmt_seconds(p.fwd_time)}, "
               f"backward {fmt_seconds(p.bwd_time)})",
               f"  predicted peak device memory {fmt_bytes(p.peak_device_bytes)} = model states "
               f"{fmt_bytes(p.model_state_bytes)} + activations {fmt_bytes(p.activation_peak_bytes)} "
               f"(at {p.peak_at}); budget {fmt_bytes(self.plan.device_memory)} with "
               f"{self.plan.memory_margin:.0%} margin",
               f"  host memory for swapped activations {fmt_bytes(p.swap_host_bytes)}"
               + (f"; NVMe {fmt_bytes(p.ssd_bytes)} per iteration" if p.ssd_bytes else ""),
               f"  search {fmt_seconds(self.plan.search_seconds)} over {self.plan.candidates_total} "
               f"candidates ({self.plan.profile_source} profile"
               + (f", profiled in {self.profile_seconds:.2f} s)" if self.profile_seconds else ")")]
        out += [f"  note: {n}" for n in self.plan.notes]
        return "\n".join(out)


def plan_activations(model: nn.Module | Sequence[nn.Module], sample: Sample | None = None, *,
                     profile: ModelProfile | None = None, states: MegatronStates | None = None,
                     device_memory: int | None = None, host_memory: int | None = None,
                     memory_margin: float = 0.10, pins: KnobPins | Mapping[str, int] | None = None,
                     ssd_path: str | None = None, ssd_verify: bool = False, ssd_min_bytes: int = 2**20,
                     hardware: HardwareProfile | None = None, in_flight_microbatches: int = 1,
                     plan_file: str | None = None, prefer_native: bool = True,
                     accounting: bool = False, verbose: bool = True, progress: bool = True,
                     fallback_profile: Callable[[], ModelProfile] | None = None) -> AppliedPlan:
    """Plan and apply per-layer activation modes for a built megatron-core model.

    ``sample`` is profiled once (forward + backward, weights untouched) unless a ``profile`` is
    given. ``states`` are the model-state bytes Megatron keeps per rank (default: this rank's
    parameters with Megatron's mixed-precision Adam, not distributed). ``device_memory``
    defaults to the device's capacity; ``host_memory`` is the node's, each of its ranks plans
    for its share (default: this rank's share of what the host can give); ``pins`` may fix
    n_checkpoint / n_swap / n_ssd.
    ``in_flight_microbatches`` > 1 (pipeline parallelism) multiplies the activation memory and
    rules out swap / NVMe. NVMe layers write their saved tensors under ``ssd_path`` (storages
    under ``ssd_min_bytes`` stay on the device; ``ssd_verify`` checksums what is read back).
    ``plan_file``: load the plan from there if it exists, else save it.
    ``fallback_profile()`` gives the profile to plan from if profiling runs out of device memory
    (Megatron-LM passes its analytic profile). Raises ``InfeasibleError`` with what would fit
    when nothing does.
    """
    core = unwrap(model)
    sizes = parallel_sizes()
    pins = _pins(pins)
    if in_flight_microbatches < 1:
        raise ValueError(f"in_flight_microbatches must be >= 1, got {in_flight_microbatches}")
    allowed = _allowed_modes(core, pins, pipelined=in_flight_microbatches > 1 or sizes["pp"] > 1,
                             in_flight=in_flight_microbatches, ssd_path=ssd_path)
    prefer_native = prefer_native or allowed.native_only is not None
    if states is None:
        states = _own_states(core)
    config = PlannerConfig(device_memory=device_memory, host_memory=host_memory,
                           memory_margin=memory_margin, pins=allowed.pins,
                           model_states_fixed=states.total_bytes, cpu_optim_overlap=False)
    ranks = _plan_ranks()
    steps = _MegatronSteps(core, sample, allowed, ranks, states=states, device_memory=device_memory,
                           plan_file=plan_file, ssd_path=ssd_path, hardware=hardware,
                           in_flight=in_flight_microbatches, prefer_native=prefer_native,
                           verbose=verbose, progress=progress, fallback_profile=fallback_profile)
    session = PlanningSession(ranks, steps.steps(), plan_file=plan_file, profile=profile)
    decision = session.decide(config, None)
    policy = ActivationPolicy(model, decision.plan, ssd_path=ssd_path, ssd_verify=ssd_verify,
                              ssd_min_bytes=ssd_min_bytes, accounting=accounting, native=prefer_native,
                              pipeline_parallel=max(sizes["pp"], in_flight_microbatches))
    applied = AppliedPlan(decision.plan, policy, states, session.profile, decision.profile_seconds)
    if verbose and ranks.decides:
        print(applied.explain(), flush=True)
        if decision.loaded:
            print(f"ProTrain: plan loaded from {plan_file} (no profiling or search)", flush=True)
        if policy.storage_backend:
            print(f"ProTrain: NVMe layers via {policy.storage_backend} in "
                  f"{policy.activations.rundir.path}", flush=True)
    return applied


@dataclass(frozen=True, slots=True)
class _AllowedModes:
    """What the model and the launch allow the search, and why (the plan's notes)."""

    pins: KnobPins
    """The user's pins, with what cannot run here pinned to 0."""
    notes: tuple[str, ...]
    """Why modes are off (the plan's first notes)."""
    native_only: str | None
    """Why only Megatron's own recompute can run this model (None: the layer hooks can)."""


def _allowed_modes(core: nn.Module, pins: KnobPins, *, pipelined: bool, in_flight: int,
                   ssd_path: str | None) -> _AllowedModes:
    """``pins`` with the modes this model and launch cannot run pinned to 0 (a pin the user
    set to more is refused): swap and NVMe with several micro-batches in flight, every hook
    mode where only Megatron's own recompute runs, NVMe without an SSD path."""
    notes = []
    if pipelined:
        if (pins.n_swap or 0) > 0 or (pins.n_ssd or 0) > 0:
            raise ValueError(f"pins n_swap={pins.n_swap}, n_ssd={pins.n_ssd}: swap and NVMe need one "
                             f"micro-batch in flight; pipeline parallelism keeps "
                             f"{in_flight}; pin them to 0")
        pins = replace(pins, n_swap=0, n_ssd=0)
        n = in_flight
        notes.append(f"pipeline parallel: {n} micro-batch{'es' if n != 1 else ''} in flight on this "
                     f"stage; swap and NVMe off, activation memory counted per micro-batch in flight")
    native_only = native_only_reason(core)
    if native_only:
        if (pins.n_swap or 0) > 0 or (pins.n_ssd or 0) > 0:
            raise ValueError(f"pins n_swap={pins.n_swap}, n_ssd={pins.n_ssd}: {native_only}; only keep / "
                             f"recompute are supported there - pin them to 0")
        pins = replace(pins, n_swap=0, n_ssd=0)
        notes.append(f"{native_only}: swap and NVMe off, recompute through Megatron's own (first layers)")
        # The selective mode runs through ProTrain's layer hooks (protrain.runtime.selective).
        if (pins.n_selective or 0) > 0:
            raise ValueError(f"pin n_selective={pins.n_selective}: {native_only}; pin it to 0")
        pins = replace(pins, n_selective=0)
    if ssd_path is None:
        if (pins.n_ssd or 0) > 0:
            raise ValueError(f"pin n_ssd={pins.n_ssd} needs an SSD path (ssd_path / --protrain-ssd-path)")
        pins = replace(pins, n_ssd=0)
    return _AllowedModes(pins, tuple(notes), native_only or None)


def _own_states(core: nn.Module) -> MegatronStates:
    """This rank's parameters with Megatron's mixed-precision Adam, not distributed."""
    params = sum(p.numel() for p in core.parameters())
    half = next(core.parameters()).element_size() == 2
    return MegatronStates(params=params, param_bytes=2 if half else 4, optimizer_bytes=12 if half else 8)


class _MegatronSteps:
    """The planning session's steps for a Megatron model (protrain.session): the decider's
    plan file decides for its group (the file may exist on its disk only); every rank of the
    group profiles (tensor-parallel ranks run the forward together); the decider searches the
    activation modes (Megatron keeps its model states, a fixed part of the peak)."""

    def __init__(self, core: nn.Module, sample: Sample | None, allowed: _AllowedModes, ranks: PlanRanks,
                 *, states: MegatronStates, device_memory: int | None, plan_file: str | None,
                 ssd_path: str | None, hardware: HardwareProfile | None, in_flight: int,
                 prefer_native: bool, verbose: bool, progress: bool,
                 fallback_profile: Callable[[], ModelProfile] | None):
        self.core, self.sample, self.allowed, self.ranks = core, sample, allowed, ranks
        self.n_layers = len(decoder_layers(core))
        self.device = model_device(core)
        self.states, self.device_memory, self.plan_file = states, device_memory, plan_file
        self.ssd_path, self.hardware, self.in_flight = ssd_path, hardware, in_flight
        self.prefer_native, self.verbose, self.progress = prefer_native, verbose, progress
        self.fallback_profile = fallback_profile
        self.notes = list(allowed.notes)
        """The plan's notes: what the model and launch allowed, and what the steps met."""

    def steps(self) -> PlanningSteps:
        return PlanningSteps(
            load=lambda planner, target: _load(self.plan_file, self.n_layers, self.states,
                                               self.device_memory, _sample_shape(self.sample)),
            measure=self.measure, machine=self.machine, search=self.search, word=self.word,
            measured_together=True, ssd_path=self.ssd_path,
            # this host's limits, shared by its ranks (a given machine keeps its own figures)
            host=None if self.hardware is not None else
            lambda: read_host_limits(ranks_per_node=_ranks_per_node()))

    def measure(self, _batch) -> ModelProfile:
        """Every rank: the profile of ``sample``; the analytic one (``fallback_profile``) on
        every rank when profiling runs out of memory on any."""
        if self.sample is None:
            raise ValueError("plan_activations needs a sample batch (or a profile) to measure the model")
        oom = None
        try:
            profile = profile_megatron(self.core, self.sample, device=self.device,
                                       progress=self.progress and self.verbose)
        except torch.OutOfMemoryError as e:
            oom = str(e).splitlines()[0]
        # The ranks of the group profile together and must plan from the same kind of
        # profile: if one ran out of memory (an asymmetric case: after its last collective),
        # every one falls back, or every one stops - never one alone, which would leave its
        # peers waiting in the next collective.
        if self.ranks.any(oom is not None, self.device):
            if self.fallback_profile is None:
                raise torch.OutOfMemoryError(oom or "a tensor-parallel peer ran out of device "
                                             "memory while profiling")
            if self.verbose:
                print(f"ProTrain: profiling ran out of device memory ({oom or 'on a peer rank'}); "
                      f"planning from the analytic profile instead", flush=True)
            _empty_cache(self.device)
            profile = self.fallback_profile()
            self.notes.append("profiled analytically: the keep-all profiling iteration did not fit")
        return profile

    def machine(self) -> HardwareProfile:
        """The decider: the node's figures (or those given), the SSD tier's, and this rank's
        share of the host."""
        hw = self.hardware or _probe(self.device, self.verbose)
        if self.ssd_path:
            from protrain.measure.probe import probe_storage
            ssd = probe_storage(self.ssd_path, self.device)
            hw = replace(hw, **{k: v for k, v in ssd.items() if k != "backend"})
        local = _ranks_per_node()
        if local > 1:
            # Every rank on this host swaps to the same memory and writes to the same drive,
            # and shares its cores and memory bus: the search gives each rank 1/local of the
            # node's figures (cost.host_share).
            hw = replace(hw, ranks_per_node=local)
            self.notes.append(f"host memory and NVMe space shared by {local} ranks on this host")
        return hw

    def search(self, profile: ModelProfile, hw: HardwareProfile, config: PlannerConfig, _target) -> Plan:
        """The decider: the fastest activation plan that fits, run through Megatron's own
        recompute when that is as good."""
        if profile.n_blocks != self.n_layers:
            raise ValueError(f"the profile has {profile.n_blocks} blocks but the model runs "
                             f"{self.n_layers} layers on this rank")
        planned = scale_in_flight(profile, self.in_flight) if self.in_flight > 1 else profile
        plan = search(planned, hw, config)
        if self.prefer_native:
            plan = _prefer_native(plan, planned, hw, config, required=self.allowed.native_only is not None)
        if self.notes:
            plan = replace(plan, notes=plan.notes + tuple(self.notes))
        return plan

    def word(self, failure: PlanFailure) -> BaseException:
        """The decider's error: its own on the decider, named on the others."""
        if failure.own is not None:
            return failure.own
        return InfeasibleError(f"protrain (rank {self.ranks.decider}, which plans for this rank): "
                               f"{failure.message}")


def profile_megatron(core: nn.Module, sample: Sample, *, device: torch.device,
                     progress: bool = True) -> ModelProfile:
    """One traced keep-all iteration of ``core`` on ``sample`` (Megatron's recompute is
    switched off meanwhile: the profile must see every activation)."""
    from protrain.measure.profiler import profile_model

    from .policy import _configs
    layers = decoder_layers(core)
    configs = _configs(core)
    saved = [(c.recompute_granularity, c.recompute_method, c.recompute_num_layers) for c in configs]
    for c in configs:
        c.recompute_granularity = c.recompute_method = c.recompute_num_layers = None
    if callable(sample):
        step = sample
        micro_batch = seq = None
    else:
        batch = dict(sample)
        ids = batch.get("input_ids")
        micro_batch, seq = (int(ids.shape[0]), int(ids.shape[1])) if ids is not None and ids.dim() == 2 \
            else (None, None)

        def step(m):
            out = m(**batch)
            return out.float().mean() if isinstance(out, torch.Tensor) and out.numel() > 1 else out
    try:
        return profile_model(core, step, blocks=layers, device=device, name=type(core).__name__,
                             micro_batch=micro_batch, seq_len=seq, progress=progress)
    finally:
        for c, (g, m, n) in zip(configs, saved):
            c.recompute_granularity, c.recompute_method, c.recompute_num_layers = g, m, n


def scale_in_flight(profile: ModelProfile, k: int) -> ModelProfile:
    """A pipeline stage keeps up to ``k`` micro-batches' activations (1F1B): every activation
    figure times ``k``. Conservative: one micro-batch's transients are counted k times."""
    return scale_figures(profile, memory=k, io=1.0)


def _prefer_native(plan: Plan, profile, hw, config, required: bool = False) -> Plan:
    """A plan of kept and recomputed layers runs through Megatron's own recompute if the same
    counts, recomputing the first layers, fit and are as fast (they usually are: same FLOPs).
    ``required``: the model can only run native recompute; raise if the prefix does not fit."""
    modes = plan.block_modes
    if native_recompute_layers(modes) is not None or any(
            m in (BlockMode.SWAP, BlockMode.SSD, BlockMode.SELECTIVE) for m in modes):
        return plan          # Megatron's own recompute cannot run these
    n = plan.knobs.n_checkpoint
    prefix = tuple(BlockMode.CKPT if i < n else BlockMode.NONE for i in range(len(modes)))
    try:
        alt = evaluate(profile, hw, plan.knobs, config, check_fit=True, block_modes=prefix,
                       search_seconds=plan.search_seconds, evaluated=plan.candidates_evaluated,
                       total=plan.candidates_total)
    except InfeasibleError:
        if required:
            raise
        return plan
    if required or _as_fast(alt, plan, profile, hw, config):
        return replace(alt, notes=alt.notes + (
            "recomputed layers moved to the front so Megatron's native recompute runs them",))
    return plan


def _as_fast(alt: Plan, plan: Plan, profile: ModelProfile, hw, config) -> bool:
    """``alt`` is within 1% of ``plan``'s predicted time, judged with every layer's times
    replaced by the mean over the layers of the same shape. Why: layers of the same shape do
    the same FLOPs, and one measured iteration makes their times differ by more than 1% on a
    busy machine, which alone would decide which of two identical layers to recompute."""
    smooth = _shape_mean_times(profile)
    fast = lambda p: evaluate(smooth, hw, p.knobs, config, block_modes=p.block_modes)  # noqa: E731
    return fast(alt).prediction.iter_time <= fast(plan).prediction.iter_time * 1.01


def _shape_mean_times(profile: ModelProfile) -> ModelProfile:
    """``profile`` with each block's forward and backward times the mean over the blocks of
    its shape (parameter elements, input bytes, saved bytes)."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, p in enumerate(profile.parts):
        if p.kind == "block":
            groups.setdefault((p.param_numel, p.in_bytes, p.saved_bytes), []).append(i)
    parts = list(profile.parts)
    for members in groups.values():
        fwd = sum(parts[i].fwd_time for i in members) / len(members)
        bwd = sum(parts[i].bwd_time for i in members) / len(members)
        for i in members:
            parts[i] = replace(parts[i], fwd_time=fwd, bwd_time=bwd)
    return replace(profile, parts=tuple(parts))


def _pins(pins) -> KnobPins:
    if pins is None:
        return KnobPins()
    if isinstance(pins, KnobPins):
        d = pins.pinned()
    else:
        d = dict(pins)
    bad = [k for k in d if k not in ACTIVATION_KNOBS]
    if bad:
        raise ValueError(f"pin {bad[0]}: Megatron keeps its own model states, so only "
                         f"{', '.join(ACTIVATION_KNOBS)} can be pinned")
    for k, v in d.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"pin {k}={v!r}: must be a non-negative integer")
    return KnobPins(**d)


def _empty_cache(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _probe(device, verbose):
    """The node's figures, measured once per node (the cache entry parse_time_hardware's probe
    wrote, when it ran: the same ranks per node and threads)."""
    from protrain.measure.probe import probe_hardware
    return probe_hardware(device=device, progress=verbose, ranks_per_node=_ranks_per_node())


def _ranks_per_node() -> int:
    """Ranks sharing this host: the launcher's variables, else every rank of the launch (at
    most 8; protrain.runtime.node.before_connect, as at argument parsing, so both probes find
    the same cache entry)."""
    from protrain.runtime.node import before_connect
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return before_connect(world).ranks_per_node


def _group():
    """(process group, global rank of its decider, its size) of the ranks that must run the
    same plan: Megatron's tensor x context parallel group; every rank without Megatron's
    parallel state. (None, 0, 1) when torch.distributed is not initialised."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1
    try:
        from megatron.core import parallel_state as ps
        if ps.model_parallel_is_initialized():
            group = ps.get_tensor_and_context_parallel_group()
            return group, dist.get_global_rank(group, 0), dist.get_world_size(group)
    except (ImportError, AssertionError, RuntimeError):
        pass
    return None, 0, dist.get_world_size()


def _plan_ranks() -> PlanRanks:
    """The ranks that run one plan and their decider (see ``_group``)."""
    group, decider, _ = _group()
    return PlanRanks(DataParallel(group), decider)


def decides_plan() -> bool:
    """Whether this rank searches the plan for its group (see ``_group``)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == _group()[1]


def _sample_shape(sample) -> tuple[int | None, int | None]:
    ids = sample.get("input_ids") if isinstance(sample, dict) else None
    return (int(ids.shape[0]), int(ids.shape[1])) if ids is not None and ids.dim() == 2 else (None, None)


def _load(plan_file: str | None, n_layers: int, states: MegatronStates,
          device_memory: int | None, shape: tuple[int | None, int | None]) -> Plan | None:
    """A saved plan, if it still describes this run (else say what changed and how to re-plan).
    Without one, the file's directory must be writable (said before profiling, not after)."""
    from pathlib import Path

    from protrain.serde import unwritable
    if not plan_file:
        return None
    if not Path(plan_file).exists():
        why = unwritable(Path(plan_file).parent)
        if why is not None:
            raise ValueError(f"plan file {plan_file}: the plan could not be saved there ({why}); "
                             f"point --protrain-plan-file at a writable directory")
        return None
    plan = Plan.load(plan_file)
    p = plan.prediction
    if len(plan.block_modes) != n_layers:
        raise ValueError(f"plan file {plan_file} is for {len(plan.block_modes)} layers, this rank runs "
                         f"{n_layers}; delete it to re-plan")
    why = plan.differs_from(n_blocks=n_layers, param_bytes=plan.param_bytes, micro_batch=shape[0],
                            seq_len=shape[1])
    if why is not None:
        raise ValueError(f"plan file {plan_file} does not fit this run: {why}; delete it to re-plan")
    if p.model_state_bytes != states.total_bytes:
        raise ValueError(f"plan file {plan_file} counted {fmt_bytes(p.model_state_bytes)} of model states "
                         f"per rank, this run has {fmt_bytes(states.total_bytes)} (another model, precision "
                         f"or optimizer sharding); delete it to re-plan")
    if device_memory is not None and p.peak_device_bytes * (1 + plan.memory_margin) > device_memory:
        raise ValueError(f"plan file {plan_file} predicts {fmt_bytes(p.peak_device_bytes)} peak (with "
                         f"{plan.memory_margin:.0%} margin), above the device memory given now "
                         f"({fmt_bytes(device_memory)}); delete it to re-plan")
    return plan

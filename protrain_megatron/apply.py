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
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from protrain.block_mode import BlockMode, modes_string
from protrain.config import KnobPins, PlannerConfig
from protrain.plan import Plan
from protrain.profile.hardware import HardwareProfile
from protrain.profile.model_profile import ModelProfile
from protrain.search import InfeasibleError, evaluate, search
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
    defaults to the device's capacity; ``pins`` may fix n_checkpoint / n_swap / n_ssd.
    ``in_flight_microbatches`` > 1 (pipeline parallelism) multiplies the activation memory and
    rules out swap / NVMe. NVMe layers write their saved tensors under ``ssd_path`` (storages
    under ``ssd_min_bytes`` stay on the device; ``ssd_verify`` checksums what is read back).
    ``plan_file``: load the plan from there if it exists, else save it.
    ``fallback_profile()`` gives the profile to plan from if profiling runs out of device memory
    (Megatron-LM passes its analytic profile). Raises ``InfeasibleError`` with what would fit
    when nothing does.
    """
    core = unwrap(model)
    layers = decoder_layers(core)
    device = model_device(core)
    sizes = parallel_sizes()
    pins = _pins(pins)
    if in_flight_microbatches < 1:
        raise ValueError(f"in_flight_microbatches must be >= 1, got {in_flight_microbatches}")
    notes = []
    if in_flight_microbatches > 1 or sizes["pp"] > 1:
        if (pins.n_swap or 0) > 0 or (pins.n_ssd or 0) > 0:
            raise ValueError(f"pins n_swap={pins.n_swap}, n_ssd={pins.n_ssd}: swap and NVMe need one "
                             f"micro-batch in flight; pipeline parallelism keeps "
                             f"{in_flight_microbatches}; pin them to 0")
        pins = replace(pins, n_swap=0, n_ssd=0)
        n = in_flight_microbatches
        notes.append(f"pipeline parallel: {n} micro-batch{'es' if n != 1 else ''} in flight on this "
                     f"stage; swap and NVMe off, activation memory counted per micro-batch in flight")
    native_only = native_only_reason(core)
    if native_only:
        if (pins.n_swap or 0) > 0 or (pins.n_ssd or 0) > 0:
            raise ValueError(f"pins n_swap={pins.n_swap}, n_ssd={pins.n_ssd}: {native_only}; only keep / "
                             f"recompute are supported there - pin them to 0")
        pins = replace(pins, n_swap=0, n_ssd=0)
        prefer_native = True
        notes.append(f"{native_only}: swap and NVMe off, recompute through Megatron's own (first layers)")
    if native_only:
        # The selective mode runs through ProTrain's layer hooks (protrain.runtime.selective).
        if (pins.n_selective or 0) > 0:
            raise ValueError(f"pin n_selective={pins.n_selective}: {native_only}; pin it to 0")
        pins = replace(pins, n_selective=0)
    if ssd_path is None:
        if (pins.n_ssd or 0) > 0:
            raise ValueError(f"pin n_ssd={pins.n_ssd} needs an SSD path (ssd_path / --protrain-ssd-path)")
        pins = replace(pins, n_ssd=0)
    if states is None:
        params = sum(p.numel() for p in core.parameters())
        half = next(core.parameters()).element_size() == 2
        states = MegatronStates(params=params, param_bytes=2 if half else 4,
                                optimizer_bytes=12 if half else 8)
    t0 = time.perf_counter()
    # The decider's plan file decides for its group (the file may exist on its disk only).
    decider = decides_plan()
    plan = _load(plan_file, len(layers), states, device_memory, _sample_shape(sample)) if decider else None
    loaded = _from_decider(plan is not None)
    profile_seconds = 0.0
    failure = None
    if not loaded and profile is None:
        # Every rank profiles (tensor-parallel ranks run the forward together); one decides.
        if sample is None:
            raise ValueError("plan_activations needs a sample batch (or a profile) to measure the model")
        oom = None
        try:
            profile = profile_megatron(core, sample, device=device, progress=progress and verbose)
        except torch.OutOfMemoryError as e:
            oom = str(e).splitlines()[0]
        # The ranks of the group profile together and must plan from the same kind of
        # profile: if one ran out of memory (an asymmetric case: after its last collective),
        # every one falls back, or every one stops - never one alone, which would leave its
        # peers waiting in the next collective.
        if _any_in_group(oom is not None, device):
            if fallback_profile is None:
                raise torch.OutOfMemoryError(oom or "a tensor-parallel peer ran out of device "
                                             "memory while profiling")
            if verbose:
                print(f"ProTrain: profiling ran out of device memory ({oom or 'on a peer rank'}); "
                      f"planning from the analytic profile instead", flush=True)
            _empty_cache(device)
            profile = fallback_profile()
            notes.append("profiled analytically: the keep-all profiling iteration did not fit")
        profile_seconds = time.perf_counter() - t0
    if plan is None and decider:
        try:
            if profile.n_blocks != len(layers):
                raise ValueError(f"the profile has {profile.n_blocks} blocks but the model runs "
                                 f"{len(layers)} layers on this rank")
            planned = scale_in_flight(profile, in_flight_microbatches) if in_flight_microbatches > 1 \
                else profile
            hw = hardware or _probe(device, verbose)
            if ssd_path:
                from protrain.measure.probe import probe_storage
                ssd = probe_storage(ssd_path, device)
                hw = replace(hw, **{k: v for k, v in ssd.items() if k != "backend"})
            local = _ranks_per_node()
            if local > 1:
                # Every rank on this host swaps to the same memory and writes to the same drive,
                # and shares its cores and memory bus (cost.host_share).
                hw = replace(hw, host_memory=hw.host_memory // local,
                             nvme_free_bytes=hw.nvme_free_bytes // local, ranks_per_node=local)
                notes.append(f"host memory and NVMe space shared by {local} ranks on this host")
            config = PlannerConfig(device_memory=device_memory, host_memory=host_memory,
                                   memory_margin=memory_margin, pins=pins,
                                   model_states_fixed=states.total_bytes, cpu_optim_overlap=False)
            plan = search(planned, hw, config)
            if prefer_native:
                plan = _prefer_native(plan, planned, hw, config, required=bool(native_only))
            if notes:
                plan = replace(plan, notes=plan.notes + tuple(notes))
            if plan_file:
                plan.save(plan_file)
        except (InfeasibleError, ValueError) as e:
            failure = e
    plan, error = _share(plan, failure)
    if error is not None:
        if failure is not None:
            raise failure
        raise InfeasibleError(f"protrain (rank {_group()[1]}, which plans for this rank): {error}")
    policy = ActivationPolicy(model, plan, ssd_path=ssd_path, ssd_verify=ssd_verify,
                              ssd_min_bytes=ssd_min_bytes, accounting=accounting, native=prefer_native,
                              pipeline_parallel=max(sizes["pp"], in_flight_microbatches))
    applied = AppliedPlan(plan, policy, states, profile, profile_seconds)
    if verbose and decider:
        print(applied.explain(), flush=True)
        if loaded:
            print(f"ProTrain: plan loaded from {plan_file} (no profiling or search)", flush=True)
        if policy.storage_backend:
            print(f"ProTrain: NVMe layers via {policy.storage_backend} in "
                  f"{policy.activations.rundir.path}", flush=True)
    return applied


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
    return scale_profile(profile, memory=k, io=1.0)


def scale_profile(profile: ModelProfile, *, memory: float = 1.0, time: float = 1.0,
                  io: float | None = None) -> ModelProfile:
    """Every activation figure times ``memory``, every compute time times ``time``, the
    attention operator's input/output bytes (what context parallelism's all-to-alls move)
    times ``io`` (default ``memory``)."""
    m = lambda x: int(round(x * memory))  # noqa: E731
    io = memory if io is None else io
    parts = tuple(replace(p, in_bytes=m(p.in_bytes), saved_bytes=m(p.saved_bytes),
                          kept_bytes=m(p.kept_bytes), resaved_bytes=m(p.resaved_bytes),
                          in_shared_bytes=m(p.in_shared_bytes), sel_saved_bytes=m(p.sel_saved_bytes),
                          fwd_start=m(p.fwd_start), fwd_peak=m(p.fwd_peak), bwd_start=m(p.bwd_start),
                          bwd_peak=m(p.bwd_peak), fwd_time=p.fwd_time * time, bwd_time=p.bwd_time * time,
                          attn_fwd_time=p.attn_fwd_time * time, attn_bwd_time=p.attn_bwd_time * time,
                          attn_io_bytes=int(round(p.attn_io_bytes * io)))
                  for p in profile.parts)
    return replace(profile, parts=parts, ops=())


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


def decides_plan() -> bool:
    """Whether this rank searches the plan for its group (see ``_group``)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == _group()[1]


def _any_in_group(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank of this rank's group (every rank must call it)."""
    group, _, size = _group()
    if size == 1:
        return flag
    dev = device if torch.distributed.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor([float(flag)], device=dev)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def _from_decider(value):
    group, src, size = _group()
    if size == 1:
        return value
    obj = [value]
    torch.distributed.broadcast_object_list(obj, src=src, group=group)
    return obj[0]


def _share(plan: Plan | None, failure: BaseException | None):
    """The decider's plan (or its error) on every rank of its group."""
    mine = (plan.to_dict() if plan is not None else None, str(failure) if failure is not None else None)
    d, err = _from_decider(mine)
    return (plan if decides_plan() else (Plan.from_dict(d) if d is not None else None)), err


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

"""The context-parallel degree, chosen before Megatron-LM builds its process groups.

With ``--protrain-auto-memory`` and no ``--context-parallel-size`` on the command line, the
parsed arguments get the CP the planner finds fastest among those that fit (AutoSP's choice of
the sequence-parallel degree, the same search as the DeepSpeed side: protrain.sp.planner). A
``--context-parallel-size`` the user gave is a pin: checked against the constraints, never
changed. Nothing is measured yet at argument parsing (no model, no process group), so the
choice plans from the analytic profile of one pipeline stage per tensor-parallel rank:

- each CP rank holds 1/CP of every activation and does 1/CP of the projections' and MLP's
  FLOPs and 1/CP of attention's (whole sequence, heads / CP), plus the all-to-alls before and
  after attention (protrain.sp.scaling);
- the global batch stays the user's: CP ranks come out of the data-parallel ones, so each rank
  runs CP times more micro-batches of the same size (Megatron's num_microbatches);
- the model states do not change with CP (the distributed optimizer shards over data x
  context parallel ranks: world / (TP x PP) either way);
- constraints: CP divides world / (TP x PP), the heads per tensor-parallel rank and, with GQA,
  the key/value heads per rank (or is a multiple of them: ProTrain's all-to-all replicates
  them; Transformer Engine's does not), and 2 CP divides the sequence (Megatron's
  load-balanced causal split).

Every rank decides alone, from the same arguments and hardware figures; the get_model wrapper
checks that they agree before anything runs (protrain_megatron.training).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, replace

from protrain.config import ConfigError, KnobPins, PlannerConfig
from protrain.plan import Plan
from protrain.profile.hardware import HardwareProfile
from protrain.profile.machines import machine_for_device
from protrain.search import InfeasibleError
from protrain.sp.degree import SPShape
from protrain.sp.planner import search_sequence_parallel

from .arguments import MegatronOptions
from .state_bytes import MegatronStates

FLAG = "--context-parallel-size"
AUTO = f"(or leave {FLAG} out and --protrain-auto-memory chooses it)"


@dataclass(frozen=True, slots=True)
class ContextParallelChoice:
    """What was decided for ``--context-parallel-size`` and ``--cp-comm-type``, and why."""

    degree: int
    """The context-parallel size the run uses."""
    pinned: bool
    """The user gave it on the command line (checked, not chosen)."""
    comm_type: str | None
    """``cp_comm_type`` set by ProTrain ("a2a" with Transformer Engine), None: left as it was."""
    reasons: tuple[str, ...]
    """One line per degree considered (its predicted step and peak, or why it does not fit)."""
    plan: Plan | None = None
    """The activation plan predicted with the chosen degree (analytic; get_model re-plans from
    the measured model)."""

    def explain(self) -> str:
        how = "pinned by the command line" if self.pinned else "chosen by ProTrain"
        out = [f"ProTrain: --context-parallel-size {self.degree} ({how})"]
        if self.comm_type:
            out.append(f"  --cp-comm-type {self.comm_type} (Transformer Engine's all-to-all, "
                       f"DeepSpeed-Ulysses style)")
        elif self.degree > 1:
            out.append("  attention through ProTrain's all-to-all (Transformer Engine not used: "
                       "protrain_megatron.sdpa_attention)")
        out += [f"  {r}" for r in self.reasons]
        return "\n".join(out)


def user_set(parser, argv, dest: str) -> bool:
    """Whether ``argv`` sets the option stored in ``dest`` (any of its spellings, ``--x=v`` too)."""
    flags = [s for a in parser._actions if a.dest == dest for s in a.option_strings]
    return any(arg == f or arg.startswith(f + "=") for arg in argv for f in flags)


def transformer_engine_used(args) -> bool:
    return getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine" and \
        importlib.util.find_spec("transformer_engine") is not None


def megatron_cp_shape(args, world: int, te: bool) -> SPShape:
    """The constraints on CP for this launch."""
    tp = args.tensor_model_parallel_size or 1
    pp = args.pipeline_model_parallel_size or 1
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) and \
        getattr(args, "num_query_groups", None) else heads
    return SPShape(world=world // (tp * pp), heads=heads // tp, kv_heads=max(1, groups // tp),
                   seq_len=args.seq_length, seq_multiple=2, knob="CP", kv_replication=not te,
                   world_label=f"the ranks per tensor x pipeline parallel group ({world} ranks / "
                               f"(TP {tp} x PP {pp}) = {world // (tp * pp)})")


def choose_context_parallel(args, opts: MegatronOptions, *, world: int, pinned: bool,
                            hardware=None) -> ContextParallelChoice:
    """The CP for ``args`` (parsed, not yet validated) on ``world`` ranks. ``pinned``: the
    user gave ``args.context_parallel_size``. Raises ConfigError for a pin that breaks a
    constraint and InfeasibleError when no degree fits."""
    from .apply import scale_in_flight
    from .training import analytic_stage_profile, model_shape

    te = transformer_engine_used(args)
    tp = args.tensor_model_parallel_size or 1
    pp = args.pipeline_model_parallel_size or 1
    if world % (tp * pp):
        raise ConfigError(f"WORLD_SIZE {world} is not divisible by --tensor-model-parallel-size {tp} x "
                          f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} ranks")
    missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                           "micro_batch_size") if not getattr(args, f, None)]
    if missing:
        raise ConfigError(f"--protrain-auto-memory needs the model's shape to choose "
                          f"{FLAG}: set {', '.join('--' + m.replace('_', '-') for m in missing)}")
    groups = world // (tp * pp)
    shape = megatron_cp_shape(args, world, te)
    hw = hardware or parse_time_hardware()
    if opts.device_memory:
        hw = replace(hw, device_memory=opts.device_memory)
    hw, links = with_link_figures(hw)
    layers = -(-args.num_layers // pp)
    profile = analytic_stage_profile(args, layers, args.seq_length, tp, hardware=hw)
    params = model_shape(args, args.num_layers, args.seq_length).total_params() // (tp * pp)
    dist_args = _Namespace(args, data_parallel_size=groups, context_parallel_size=1)
    states = MegatronStates.from_args(dist_args, params)
    gbs = getattr(args, "global_batch_size", None) or args.micro_batch_size * groups
    micro = max(1, gbs // (args.micro_batch_size * groups))
    # NVMe is left out of this choice (its drive is probed once the model exists): a CP
    # that fits without it fits with it.
    pins = KnobPins(**{**dict(opts.pins), "n_ssd": 0,
                       "sequence_parallel": args.context_parallel_size if pinned else None})
    notes = [links] if links and groups > 1 else []
    per_rank = None
    if pp > 1:
        pins = replace(pins, n_swap=0)
        in_flight = min(pp, micro)
        per_rank = lambda p: scale_in_flight(p, in_flight) if in_flight > 1 else p  # noqa: E731
        notes.append(f"pipeline parallel: {in_flight} micro-batches in flight on the first stage")
    if getattr(args, "fp8", None) or getattr(args, "fp4", None):
        pins = replace(pins, n_swap=0, n_selective=0)
    config = PlannerConfig(device_memory=opts.device_memory, host_memory=opts.host_memory,
                           memory_margin=opts.memory_margin, pins=pins,
                           model_states_fixed=states.total_bytes, cpu_optim_overlap=False,
                           data_parallel_size=groups, grad_accumulation_steps=micro)
    plan = search_sequence_parallel(profile, hw, config, seq_len=args.seq_length, shape=shape,
                                    per_rank=per_rank, where=FLAG, auto=AUTO)
    degree = plan.knobs.sequence_parallel or 1
    if getattr(args, "vocab_size", None) is None and getattr(args, "padded_vocab_size", None) is None:
        from .training import DEFAULT_VOCAB
        notes.append(f"vocabulary size not known before the tokenizer loads: {DEFAULT_VOCAB} assumed "
                     f"(--vocab-size gives it)")
    notes.append(f"analytic profile of {layers} layers per stage and tensor-parallel rank; the "
                 f"activation plan is made again from the measured model once it is built")
    reasons = tuple(n for n in plan.notes if n.startswith("CP")) + tuple(notes)
    comm = "a2a" if te and degree > 1 else None
    return ContextParallelChoice(degree=degree, pinned=pinned, comm_type=comm, reasons=reasons, plan=plan)


def decide_context_parallel(args, parser, argv) -> ContextParallelChoice | None:
    """Set ``args.context_parallel_size`` (and ``cp_comm_type``) for ``--protrain-auto-memory``
    right after parsing; print the choice on rank 0. Exits naming the flag on bad input."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pinned = user_set(parser, argv, "context_parallel_size")
    if getattr(args, "hierarchical_context_parallel_sizes", None) and not pinned:
        return None          # the user's hierarchical CP layout: theirs to size
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if not pinned and world % (tp * pp) == 0 and world // (tp * pp) < 2:
        return None          # one rank per tensor x pipeline group: CP is 1, nothing to probe
    opts = MegatronOptions.from_args(args)
    try:
        choice = choose_context_parallel(args, opts, world=world, pinned=pinned)
    except (ConfigError, InfeasibleError) as e:
        raise SystemExit(f"protrain: {e}") from None
    args.context_parallel_size = choice.degree
    if choice.comm_type and not user_set(parser, argv, "cp_comm_type"):
        args.cp_comm_type = [choice.comm_type]
    else:
        choice = replace(choice, comm_type=None)
    args.protrain_cp_choice = choice.degree
    if not pinned:
        agree_before_groups()
    if int(os.environ.get("RANK", "0")) == 0:
        print(choice.explain(), flush=True)
    return choice


def agree_before_groups() -> None:
    """Every rank chose its CP alone; before Megatron creates its process groups from it
    (ranks with different sizes would create different groups and wait on each other for
    ever), check that all chose the same, and stop naming the values if not."""
    from megatron.core import parallel_state as ps
    original = ps.initialize_model_parallel
    if getattr(original, "_protrain", False):
        return

    def initialize_model_parallel(*args, **kwargs):
        import inspect

        import torch
        import torch.distributed as dist
        bound = inspect.signature(original).bind_partial(*args, **kwargs)
        cp = int(bound.arguments.get("context_parallel_size", 1))
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if dist.get_backend() == "nccl" else torch.device("cpu")
            t = torch.tensor([cp, -cp], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            high, low = int(t[0]), -int(t[1])
            if high != low:
                raise SystemExit(f"protrain: the ranks chose different context-parallel sizes "
                                 f"({low} to {high}; this rank {cp}): their hardware figures differ. "
                                 f"Pin one with {FLAG} N (this rank's choice: {cp})")
        return original(*args, **kwargs)
    initialize_model_parallel._protrain = True
    ps.initialize_model_parallel = initialize_model_parallel


def with_link_figures(hw: HardwareProfile) -> tuple[HardwareProfile, str | None]:
    """``hw`` with all-to-all and all-reduce bandwidths to plan with, and how they were had
    (None: ``hw`` had them). At argument parsing the ranks are not connected yet, so the links
    cannot be measured (the DeepSpeed side measures them with the ranks launched): the
    published figure of a named GPU (protrain.profile.machines), else the host link's
    measured copy bandwidth, the floor of a link between devices without NVLink."""
    known = hw.alltoall_bandwidth or hw.collective_bandwidth
    if known > 0:
        return replace(hw, alltoall_bandwidth=hw.alltoall_bandwidth or known,
                       collective_bandwidth=hw.collective_bandwidth or known), None
    named = machine_for_device(hw.name) if hw.device_type == "cuda" else None
    if named is not None and named.collective_bandwidth > 0:
        bw, how = named.collective_bandwidth, f"the published figure of {named.name}"
    else:
        bw = min(hw.h2d_bandwidth, hw.d2h_bandwidth)
        how = f"the host link's measured copy bandwidth; no published figure for {hw.name}"
    if bw <= 0:
        raise ConfigError(f"{hw.name}: no link bandwidth to plan {FLAG} with; pin it with {FLAG} N")
    return replace(hw, alltoall_bandwidth=bw, collective_bandwidth=bw), (
        f"all-to-all bandwidth {bw / 1e9:.1f} GB/s assumed ({how}): the ranks are not connected "
        f"yet when {FLAG} is chosen")


def parse_time_hardware():
    """The hardware figures to plan with before torch.distributed or the model exist: the
    probe's on this rank's device, measured once per node - every rank of the launch gets
    here at once, and one of a node's ranks measures while the others wait on the probe's lock
    and then read its figures (protrain.measure.probe), so they are the same on every rank of
    the node and uncontended. Ranks on other nodes measure their own: figures that differ
    could still split the choice; the get_model wrapper checks that the ranks agreed."""
    import torch

    from protrain.measure.probe import probe_hardware
    from protrain.runtime.node import before_connect
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))   # as Megatron will
    share = before_connect(int(os.environ.get("WORLD_SIZE", "1")))
    return probe_hardware(progress=False, ranks_per_node=share.ranks_per_node)


class _Namespace:
    """``args`` with some attributes replaced (read-only view)."""

    def __init__(self, args, **override):
        self._args, self._override = args, override

    def __getattr__(self, name):
        if name in self._override:
            return self._override[name]
        return getattr(self._args, name)

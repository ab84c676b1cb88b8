"""``protrain`` console command: plan, probe, explain, list.

``protrain plan`` works without a GPU: give a model (a preset, a Hugging Face config.json or a
few shape flags) and a machine (a named GPU with its published figures, or a hardware profile
saved by ``protrain probe``), and it prints the plan an analytic profile gives. ``--measure``
instead profiles the built-in GPT on this machine with the real profiler and probe.

Exit status: 0 plan printed, 2 bad arguments, 3 no plan fits (the message says what would).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace

from .config import KNOB_NAMES, ConfigError, PlannerConfig
from .units import GiB, fmt_bytes, parse_bytes

EXIT_INFEASIBLE = 3


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seq(text: str) -> int | str:
    if text == "max":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"--seq {text!r}: give the sequence length in tokens (e.g. --seq 4096), or --seq max "
            f"for the longest that fits")
    return n


def _pin(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or key not in KNOB_NAMES:
        raise argparse.ArgumentTypeError(
            f"--pin {text!r}: write KNOB=VALUE with KNOB one of {', '.join(KNOB_NAMES)}, "
            f"e.g. --pin n_persist=4 or --pin chunk_size=64MiB")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    from .profile.analytic import PRESETS
    from .profile.machines import MACHINES
    ap = argparse.ArgumentParser(prog="protrain", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("plan", help="plan memory for a model on a machine",
                       description="Plan the memory of training a model on a machine and print "
                                   "the plan. Without a GPU: an analytic profile of the shape.")
    m = p.add_argument_group("model (one of --model, --hf-config, or the shape flags)")
    m.add_argument("--model", help=f"preset: {', '.join(PRESETS)}; with --measure: gpt-tiny, "
                                   f"gpt-small, gpt-1b (the built-in GPT)")
    m.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (GPT-2 or LLaMA style)")
    m.add_argument("--family", choices=["gpt2", "llama"], default="llama")
    m.add_argument("--layers", type=int)
    m.add_argument("--hidden", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--kv-heads", type=int)
    m.add_argument("--ffn-hidden", type=int)
    m.add_argument("--vocab", type=int, default=32000)
    m.add_argument("--seq", type=_seq, help="sequence length (default: the preset's, else 1024); max: "
                                            "the longest that fits (multiples of 128 x P), and its plan")
    m.add_argument("--micro-batch", type=int, default=1)
    m.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    m.add_argument("--measure", action="store_true",
                   help="profile the built-in GPT on this machine (GPU if present, else CPU) with "
                        "the real profiler and hardware probe, instead of an analytic estimate")
    h = p.add_argument_group("machine")
    h.add_argument("--gpu", default="h100-80gb", help=f"named GPU: {', '.join(MACHINES)} (default h100-80gb)")
    h.add_argument("--hardware", metavar="PATH", help="a hardware profile saved by `protrain probe --save`")
    h.add_argument("--host-memory", type=_size,
                   help="the node's host memory for offloaded states and swapped activations, as "
                        "`free` shows it: each of its --ranks-per-node ranks plans for its share "
                        "(default 128GiB for named GPUs, measured otherwise)")
    h.add_argument("--device-memory", type=_size, help="cap the device memory the plan may use")
    h.add_argument("--cpu-adam-rate", type=float, help="CPU Adam parameters/s (named GPUs assume 1e9)")
    h.add_argument("--nvme", type=float, metavar="GB/s",
                   help="a drive (ssd_path) with this NVMe read/write bandwidth: the planner may put "
                        "activations (n_ssd) and optimizer states (n_nvme) on it")
    h.add_argument("--nvme-free", type=_size, default=None, metavar="SIZE",
                   help="free space on the drive, shared by a node's ranks (default 1TiB)")
    h.add_argument("--gds", action="store_true", help="the SSD path supports GPUDirect Storage")
    h.add_argument("--nvme-duplex", action="store_true",
                   help="the drive reads and writes at --nvme GB/s each at once (default: the two "
                        "share its time, as the probe finds for most drives)")
    h.add_argument("--world", type=int, default=1, metavar="N",
                   help="ranks of the launch (one GPU each): model states are sharded over them and "
                        "the planner chooses the Ulysses sequence-parallel degree P among them")
    h.add_argument("--ranks-per-node", type=int, metavar="N",
                   help="ranks sharing one host (its cores, memory bus and memory): CPU Adam and "
                        "the host passes of each rank run at 1/N of the host's rates, and each "
                        "rank plans for 1/N of --host-memory (default: --world, at most 8 - an "
                        "8-GPU node)")
    s = p.add_argument_group("search")
    s.add_argument("--pin", type=_pin, action="append", default=[], metavar="KNOB=VALUE",
                   help=f"fix a knob ({', '.join(KNOB_NAMES)}); repeatable")
    s.add_argument("--margin", type=float, help="fragmentation margin (default 0.10)")
    s.add_argument("--clip", type=float, default=1.0, metavar="MAX_NORM",
                   help="gradient clipping as DeepSpeed's gradient_clipping (default 1.0; 0: off). "
                        "With clipping or --dtype fp16 (loss scaling) CPU Adam overlaps backward "
                        "speculatively (--pin speculate_chunks=N to fix how many chunks)")
    p.add_argument("--save", metavar="PATH", help="write the plan as JSON")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")

    pr = sub.add_parser("probe", help="measure this machine and print its hardware profile")
    pr.add_argument("--save", metavar="PATH", help="also write it as JSON (for plan --hardware)")
    pr.add_argument("--refresh", action="store_true", help="measure again even if cached")

    ex = sub.add_parser("explain", help="print a saved plan")
    ex.add_argument("plan", metavar="PLAN.json")
    ex.add_argument("--plot", metavar="OUT.png", help="also draw the predicted iteration (lanes: "
                    "compute, H2D, D2H, CPU Adam, NVMe; device memory under them); needs matplotlib")
    ex.add_argument("--trace", metavar="TRACE.json", help="with --plot: draw a measured iteration "
                    "beside it (the trace_file an engine wrote)")

    sub.add_parser("list", help="list model presets and named machines")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"plan": _cmd_plan, "probe": _cmd_probe, "explain": _cmd_explain,
                "list": _cmd_list}[args.cmd](args)
    except ConfigError as e:
        print(f"protrain: error: {e}", file=sys.stderr)
        return 2


def _config(args) -> PlannerConfig:
    d: dict = dict(args.pin)
    for k in KNOB_NAMES[1:] + ("speculate_chunks",):
        if k in d and k != "ckpt_input" and not (k == "n_persist" and d[k] == "all"):
            try:
                d[k] = int(d[k])
            except ValueError:
                raise ConfigError(f"--pin {k}={d[k]}: must be a whole number"
                                  + (" or all" if k == "n_persist" else "")) from None
    if args.margin is not None:
        d["memory_margin"] = args.margin
    global_first = getattr(args, "clip", 0.0) > 0 or getattr(args, "dtype", "bf16") == "fp16"
    d["cpu_optim_overlap"] = not global_first        # the norm / overflow check needs all gradients
    d["cpu_optim_speculative"] = global_first
    d["gradient_clipping"] = getattr(args, "clip", 0.0) > 0
    if args.device_memory:
        d["device_memory"] = args.device_memory
    if args.host_memory:
        d["host_memory"] = args.host_memory
    return PlannerConfig.from_dict(d, where="protrain")


def _cmd_plan(args) -> int:
    from .search import InfeasibleError
    t0 = time.perf_counter()
    if args.world < 1:
        print(f"protrain: error: --world {args.world}: must be at least 1", file=sys.stderr)
        return 2
    from .runtime.node import OFFLINE_RANKS_PER_NODE
    if args.ranks_per_node is None:
        args.ranks_per_node = min(args.world, OFFLINE_RANKS_PER_NODE)
    if not 1 <= args.ranks_per_node <= args.world:
        print(f"protrain: error: --ranks-per-node {args.ranks_per_node}: must be from 1 to --world "
              f"({args.world}); give the ranks that share one host (1: a host per rank)",
              file=sys.stderr)
        return 2
    longest = args.seq == "max"
    if longest and args.measure:
        print("protrain: error: --seq max with --measure: the built-in GPT is profiled at one length "
              "and its position table bounds it; give --seq N with --measure, or plan --seq max for "
              "--model, --hf-config or the shape flags", file=sys.stderr)
        return 2
    if longest:
        args.seq = None                     # the model's own length is where the search starts
    config = _config(args)
    try:
        if args.measure:
            profile, hw = _measured(args)
        else:
            shape, hw = _analytic_model(args)
            profile = _analytic_profile(shape, hw)
    except ValueError as e:
        print(f"protrain: error: {e}", file=sys.stderr)
        return 2
    machine_hw, hw = hw, replace(hw, ranks_per_node=args.ranks_per_node)
    try:
        if longest:
            found, best, plan = _longest(shape, machine_hw, hw, config, args.world)
        else:
            plan = _search(profile, hw, config, args.world)
    except InfeasibleError as e:
        what = f"{shape.name} at any sequence length" if longest else profile.describe()
        print(f"protrain: no plan fits {what} on {hw.name}:\n  {e}", file=sys.stderr)
        if e.seq_len_fit is not None and not longest:
            print("  (the lengths named are estimates: --seq max plans its way to the longest that "
                  "fits, and prints its plan)", file=sys.stderr)
        return EXIT_INFEASIBLE
    if args.save:
        plan.save(args.save)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        print(plan.explain())
        if profile.source == "analytic":
            print("  note: analytic profile (shapes + published peaks): an estimate; the run-time "
                  "plan uses the measured profile")
        if longest:
            from .sp.longest import describe
            print(describe(found, best, hw.with_limits(device_memory=config.device_memory,
                                                       host_memory=config.host_memory)))
        print(f"  planned in {time.perf_counter() - t0:.2f} s" + (f"; saved to {args.save}" if args.save else ""))
    return 0


def _search(profile, hw, config: PlannerConfig, world: int):
    """The plan ``protrain plan`` prints for ``profile``: over the sequence-parallel degrees
    where there are several ranks or P is pinned."""
    from .search import search
    if world > 1 or config.pins.sequence_parallel is not None:
        from .sp.planner import search_sequence_parallel
        return search_sequence_parallel(profile, hw, replace(config, data_parallel_size=world))
    return search(profile, hw, config)


def _longest(shape, machine_hw, hw, config: PlannerConfig, world: int):
    """``--seq max``: the longest sequence per degree the plan considers (each length planned
    by ``_search`` with P pinned), the longest of them, and the plan at its length (P free)."""
    from .search import InfeasibleError
    from .sp.degree import SEQ_STEP
    from .sp.longest import longest_over_degrees
    from .sp.planner import candidate_degrees

    def profile_at(seq: int):
        return _analytic_profile(replace(shape, seq_len=seq), machine_hw)

    def plan_at(seq: int, p: int):
        pinned = replace(config, pins=replace(config.pins, sequence_parallel=p)) if searched else config
        return _search(profile_at(seq), hw, pinned, world)

    searched = world > 1 or config.pins.sequence_parallel is not None
    # Every length tried for P is a multiple of 128 x P: the sequence constraint does not apply,
    # so the degrees are those of a length every P up to the world divides.
    every = SEQ_STEP * math.lcm(*range(1, world + 1))
    degrees = candidate_degrees(profile_at(shape.seq_len), config, world, every) if searched else (1,)
    limit = shape.max_positions if shape.family == "gpt2" else None     # learned positions end there
    found, best = longest_over_degrees(plan_at, degrees, start=shape.seq_len, limit=limit)
    if not best.seq_len:
        e = best.next_error
        raise InfeasibleError(f"not even {best.step} tokens fit: {e}",
                              device_needed=e.device_needed, host_needed=e.host_needed)
    plan = best.plan if len(degrees) == 1 else _search(profile_at(best.seq_len), hw, config, world)
    return found, best, plan


def _analytic_profile(shape, hw):
    from .profile.analytic import analytic_profile
    return analytic_profile(shape, hw)


def _analytic(args):
    """The analytic profile and the machine ``args`` describe."""
    shape, hw = _analytic_model(args)
    return _analytic_profile(shape, hw), hw


def _analytic_model(args):
    """The model shape and the machine ``args`` describe (``args.seq`` None: the model's)."""
    from .profile.analytic import PRESETS, ModelShape, shape_from_hf_config
    from .profile.hardware import HardwareProfile
    from .profile.machines import DEFAULT_HOST_MEMORY, machine
    dtype_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype]
    if args.hf_config:
        shape = shape_from_hf_config(args.hf_config, seq_len=args.seq, micro_batch=args.micro_batch)
    elif args.model:
        if args.model not in PRESETS:
            raise ValueError(f"unknown --model {args.model!r}; presets: {', '.join(PRESETS)} "
                             f"(or give --hf-config / --layers --hidden --heads)")
        shape = PRESETS[args.model]
        shape = replace(shape, micro_batch=args.micro_batch, seq_len=args.seq or shape.seq_len)
    elif args.layers and args.hidden and args.heads:
        shape = ModelShape(name=f"{args.family}-L{args.layers}-H{args.hidden}", family=args.family,
                           n_layers=args.layers, hidden=args.hidden, heads=args.heads,
                           vocab=args.vocab, seq_len=args.seq or 1024, micro_batch=args.micro_batch,
                           kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden)
    else:
        raise ValueError("say which model: --model PRESET, --hf-config PATH, or --layers, --hidden "
                         "and --heads (see `protrain list`), or --measure for the built-in GPT")
    shape = replace(shape, dtype_bytes=dtype_bytes)
    if args.hardware:
        hw = HardwareProfile.load(args.hardware)
        if args.host_memory:
            hw = replace(hw, host_memory=args.host_memory)
    else:
        hw = machine(args.gpu).profile(host_memory=args.host_memory or DEFAULT_HOST_MEMORY)
    if args.cpu_adam_rate:
        hw = replace(hw, cpu_adam_rate=args.cpu_adam_rate)
    if args.nvme:
        hw = replace(hw, nvme_write_bandwidth=args.nvme * 1e9, nvme_read_bandwidth=args.nvme * 1e9,
                     nvme_gds=args.gds, nvme_duplex=args.nvme_duplex,
                     nvme_free_bytes=args.nvme_free or 2**40)
    if not hw.peak_flops:
        hw = replace(hw, peak_flops=machine(args.gpu).bf16_flops)
    return shape, hw


def _measured(args):
    import torch
    from .models import GPT, PRESETS, synthetic_batch
    from .measure.probe import probe_hardware
    from .measure.profiler import profile_model
    name = args.model or ("gpt-small" if torch.cuda.is_available() else "gpt-tiny")
    if name not in PRESETS:
        raise ValueError(f"--measure profiles the built-in GPT: --model one of {', '.join(PRESETS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = PRESETS[name]
    seq = args.seq or cfg.block_size
    if seq > cfg.block_size:
        raise ValueError(f"--seq {seq} exceeds {name}'s position table ({cfg.block_size})")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if device.type == "cpu" and dtype != torch.float32:
        dtype = torch.float32  # CPU kernels in 16 bits are slow and not what a GPU run does
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=dtype)
    x, y = synthetic_batch(cfg, args.micro_batch, seq, device=device)
    print(f"protrain: profiling {name} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
          f"params, {dtype}, micro-batch {args.micro_batch}, seq {seq}) on {device}", flush=True)
    profile = profile_model(model, lambda m: m(x, y), name=name, micro_batch=args.micro_batch,
                            seq_len=seq, head_tiling=True, mlp_tiling=True)
    hw = probe_hardware(device, ranks_per_node=args.ranks_per_node)
    if args.cpu_adam_rate:
        hw = replace(hw, cpu_adam_rate=args.cpu_adam_rate)
    else:       # CPU Adam as the engine's runtime would run it ("cpu_adam": "auto", one micro-step)
        from .cost.host_update import host_update_passes, runtime_update_rate
        hw = runtime_update_rate(hw, host_update_passes(
            fused_kernel=device.type != "cpu", half=dtype != torch.float32, grad_accumulation=False,
            scaled=getattr(args, "clip", 0.0) > 0 or dtype == torch.float16))
    print(f"protrain: {hw.describe()}", flush=True)
    return profile, hw


def _cmd_probe(args) -> int:
    from .measure.probe import probe_hardware
    hw = probe_hardware(refresh=args.refresh)
    print(hw.describe())
    if args.save:
        hw.save(args.save)
        print(f"saved to {args.save}")
    return 0


def _cmd_explain(args) -> int:
    from .plan import Plan
    try:
        plan = Plan.load(args.plan)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"protrain: error: cannot read plan {args.plan}: {e}", file=sys.stderr)
        return 2
    print(plan.explain())
    if args.trace and not args.plot:
        print("protrain: error: --trace is drawn with --plot OUT.png", file=sys.stderr)
        return 2
    if args.plot:
        from .timeline import Timeline, draw
        if plan.timeline is None:
            print(f"protrain: error: {args.plan} has no predicted timeline (written by an older "
                  f"version); plan again to get one", file=sys.stderr)
            return 2
        timelines = [plan.timeline]
        if args.trace:
            try:
                timelines.append(Timeline.load(args.trace))
            except (OSError, ValueError, KeyError, TypeError) as e:
                print(f"protrain: error: cannot read trace {args.trace}: {e}", file=sys.stderr)
                return 2
        print(f"drew {draw(timelines, args.plot)}")
    return 0


def _cmd_list(args) -> int:
    from .profile.analytic import PRESETS
    from .profile.machines import MACHINES
    print("model presets (protrain plan --model NAME):")
    for s in PRESETS.values():
        print(f"  {s.name:<12} {s.family:<6} {s.n_layers:>3} layers, hidden {s.hidden:>5}, "
              f"{s.total_params() / 1e9:6.2f} B params")
    print("named machines (protrain plan --gpu NAME):")
    for mch in MACHINES.values():
        print(f"  {mch.name:<15} {fmt_bytes(mch.device_memory):>10}, {mch.bf16_flops / 1e12:.0f} "
              f"TFLOP/s bf16, PCIe {mch.pcie_bandwidth / 1e9:.0f} GB/s")
    print(f"  (host memory defaults to {fmt_bytes(128 * GiB)} per node; set --host-memory)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Megatron-LM wiring: ``--protrain-auto-memory`` in an unchanged ``pretrain_gpt.py`` launch.

The start-up hook (``protrain/_autoload.py``, active only when the flag is on the command
line) calls ``install_arguments`` when ``megatron.training.arguments`` is imported and
``install_training`` when ``megatron.training.training`` is:

- ``parse_args`` looks ``add_megatron_arguments`` up by module global at call time, so wrapping
  it adds the ProTrain group to Megatron's strict parser;
- ``setup_model_and_optimizer`` calls ``get_model`` by module global: the wrapper resets the
  flags the plan replaces (reporting the ones the user set), lets Megatron build the model,
  then profiles this rank's part on a synthetic micro-batch of the configured shape (a random
  stage input on later pipeline stages; an analytic profile if that runs out of memory),
  plans per stage and tensor-parallel group, and applies the plan before training.
"""
from __future__ import annotations

import functools
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from protrain.allocator import choose_allocator

from .apply import AppliedPlan, decides_plan, plan_activations
from .arguments import FLAG, MegatronOptions, add_protrain_arguments, take_over_flags
from .model import decoder_layers, parallel_sizes, unwrap
from .sdpa_attention import swap_core_attention
from .stage_profile import stage_profile
from .state_bytes import MegatronStates

APPLIED: list[AppliedPlan] = []
"""The plans applied in this process (one per get_model call that built a training model)."""

def install_arguments(module) -> None:
    original = module.add_megatron_arguments
    if getattr(original, "_protrain", False):
        return

    @functools.wraps(original)
    def add_megatron_arguments(parser):
        return choose_after_parsing(add_protrain_arguments(original(parser)))
    add_megatron_arguments._protrain = True
    module.add_megatron_arguments = add_megatron_arguments


def choose_after_parsing(parser):
    """Make ``parser`` choose the context-parallel degree right after it parses (Megatron-LM's
    parse_args calls it before validate_args and before any process group exists)."""
    if getattr(parser.parse_known_args, "_protrain", False):
        return parser
    original = parser.parse_known_args

    @functools.wraps(original)
    def parse_known_args(args=None, namespace=None):
        parsed, rest = original(args, namespace)
        if getattr(parsed, "protrain_auto_memory", False) and hasattr(parsed, "context_parallel_size"):
            from .context_parallel import decide_context_parallel
            decide_context_parallel(parsed, parser, sys.argv[1:] if args is None else list(args))
        return parsed, rest
    parse_known_args._protrain = True
    parser.parse_known_args = parse_known_args
    return parser


def install_training(module) -> None:
    original = module.get_model
    if getattr(original, "_protrain", False):
        return
    module.get_model = wrap_get_model(original, _megatron_args)


def _megatron_args():
    from megatron.training.global_vars import get_args
    return get_args()


def wrap_get_model(original, get_args):
    @functools.wraps(original)
    def get_model(model_provider_func, *args, **kwargs):
        margs = get_args()
        if not hasattr(margs, "protrain_auto_memory"):
            if FLAG in sys.argv:
                raise SystemExit(f"protrain: {FLAG} is on the command line but the parsed arguments "
                                 f"have no ProTrain group (--yaml-cfg replaces them); drop --yaml-cfg, "
                                 f"or call protrain_megatron.plan_activations from your script")
            return original(model_provider_func, *args, **kwargs)
        wrap_with_ddp = kwargs.get("wrap_with_ddp", args[1] if len(args) > 1 else True)
        if not margs.protrain_auto_memory or not wrap_with_ddp:
            return original(model_provider_func, *args, **kwargs)   # inference copies: untouched
        _start_allocator()            # before the model's parameters take the first segments
        opts = MegatronOptions.from_args(margs)
        overridden = take_over_flags(margs)
        # Context parallelism without Transformer Engine's attention: Megatron's local
        # DotProductAttention refuses it; ProTrain's all-to-all attention takes its place.
        with swap_core_attention((getattr(margs, "context_parallel_size", 1) or 1) > 1):
            model = original(model_provider_func, *args, **kwargs)
        APPLIED.append(apply_to_megatron_lm(model, margs, opts, overridden))
        return model
    get_model._protrain = True
    return get_model


def _start_allocator() -> None:
    """Expandable segments for CUDA's allocator unless the user set it (protrain.allocator);
    rank 0 says which."""
    line = choose_allocator()
    if line and _rank() == 0:
        print(line, flush=True)


def apply_to_megatron_lm(model, args, opts: MegatronOptions, overridden=(), *,
                         hardware=None) -> AppliedPlan:
    """Profile, plan and apply for a model Megatron-LM just built (every rank calls this).
    Each pipeline stage measures and plans its own layers; ``hardware``: a HardwareProfile
    instead of probing this machine."""
    if _rank() == 0 and overridden:
        print(f"ProTrain: the plan replaces {', '.join(overridden)} (set by the command line)", flush=True)
    sizes = parallel_sizes()
    core = unwrap(model)
    states = MegatronStates.from_args(args, sum(p.numel() for p in core.parameters()))
    in_flight = 1
    plan_file = opts.plan_file
    if sizes["pp"] > 1:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        in_flight = max(1, min(sizes["pp"] - sizes["pp_rank"], get_num_microbatches()))
        if plan_file:                 # one plan per stage: the stages differ
            path = Path(plan_file)
            plan_file = str(path.with_name(f"{path.stem}.stage{sizes['pp_rank']}{path.suffix}"))
    ddp = model[0] if isinstance(model, (list, tuple)) else model
    n_layers = len(decoder_layers(core))
    # Profiling runs backward: keep Megatron's gradient reduction out of it, and its buffers clean.
    try:
        with (ddp.no_sync() if hasattr(ddp, "no_sync") else nullcontext()):
            applied = plan_activations(
                model, synthetic_step(ddp, args, core), states=states, device_memory=opts.device_memory,
                host_memory=opts.host_memory, memory_margin=opts.memory_margin, pins=dict(opts.pins),
                ssd_path=opts.ssd_path, plan_file=plan_file, in_flight_microbatches=in_flight,
                hardware=hardware, verbose=decides_plan() and sizes["dp_rank"] == 0,
                fallback_profile=lambda: stage_profile(args, n_layers, sizes))
    finally:
        if getattr(core.decoder, "input_tensor", None) is not None:
            core.decoder.input_tensor = None     # the stage input the profile set
    if hasattr(ddp, "zero_grad_buffer"):
        ddp.zero_grad_buffer()
    return applied


def synthetic_step(ddp, args, core):
    """A micro-batch of the configured shape (random tokens; on a later pipeline stage a
    random hidden-state input) through this rank's part of the model as Megatron-LM runs it
    (Float16Module included), returning the mean of its output (the token losses on the last
    stage)."""
    net = ddp.module if hasattr(ddp, "no_sync") and hasattr(ddp, "module") else ddp
    param = next(net.parameters())
    device = param.device
    b = args.micro_batch_size
    s = args.seq_length // max(1, getattr(args, "context_parallel_size", 1) or 1)
    vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (b, s), generator=g).to(device)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)
    mask = None
    if getattr(args, "create_attention_mask_in_dataloader", False):
        mask = torch.tril(torch.ones(s, s, device=device)).view(1, 1, s, s) < 0.5
    hidden = None
    if not getattr(core, "pre_process", True):
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        rows = s // tp if getattr(args, "sequence_parallel", False) else s
        hidden = torch.randn(rows, b, args.hidden_size, generator=g).to(device, param.dtype)
        hidden.requires_grad_(True)
    last = getattr(core, "post_process", True)

    def step(_core):
        if hidden is not None:
            core.set_input_tensor(hidden)
        out = net(tokens, position_ids, mask, labels=labels if last else None)
        return out.float().mean()
    return step


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

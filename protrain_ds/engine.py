"""ProTrainEngine: a DeepSpeedEngine whose memory is run by a ProTrain plan.

Everything a DeepSpeed script uses stays DeepSpeed's: forward/backward/step, gradient
accumulation, clipping, loss scaling, LR schedulers, global_steps, get_lr, the Hugging Face
integration. What changes:

- the model stays where the user put it (``dont_change_device``): ProTrain places every
  parameter itself, in chunks;
- the optimizer DeepSpeed builds is a ProTrainOptimizer (``_configure_optimizer``);
- the first forward profiles the model on its first batch (or loads a saved plan), searches
  the plan, prints it, and builds the runtime; every forward then runs inside the runtime's
  forward context.

Private DeepSpeed methods overridden here (checked by tests/test_ds_contract.py):
``_configure_optimizer``, ``clip_fp32_gradients``, ``_broadcast_model``.
"""
from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
from deepspeed.runtime.engine import DeepSpeedEngine

from protrain.config import ConfigError
from protrain.plan import Plan
from protrain.profile.blocks import find_blocks
from protrain.profile.model_profile import ModelProfile
from protrain.profile.probe import probe_collective
from protrain.runtime.collectives import DataParallel
from protrain.runtime.runtime import ProTrainRuntime
from protrain.search import InfeasibleError, check_budgets, search

from .config import ProTrainDSConfig
from .optimizer import ProTrainOptimizer

log = logging.getLogger("protrain")


class ProTrainEngine(DeepSpeedEngine):
    def __init__(self, *args, protrain_config: ProTrainDSConfig, overridden: list[str], **kwargs):
        # Set before DeepSpeed's constructor: it calls _configure_optimizer.
        self.protrain_config = protrain_config
        self.protrain_overridden = overridden
        self.protrain_runtime: ProTrainRuntime | None = None
        self.protrain_plan: Plan | None = None
        self.protrain_profile: ModelProfile | None = None
        self._protrain_margin = 0.0
        self._protrain_redo = None
        super().__init__(*args, dont_change_device=True, **kwargs)
        # Gradients live in chunks, not in .grad: DeepSpeed's own all-reduce has nothing to do.
        self.enable_backward_allreduce = False
        if not isinstance(self.optimizer, ProTrainOptimizer):
            raise ConfigError("ProTrain needs an optimizer to train: add an \"optimizer\" section "
                              "(Adam or AdamW) to the DeepSpeed config or pass one to initialize")
        if protrain_config.ssd_path:
            _check_ssd_path(protrain_config.ssd_path)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if params:
            try:
                check_budgets(sum(p.numel() for p in params), max(p.numel() for p in params),
                              params[0].element_size(), protrain_config.planner,
                              grad_accumulation=self.gradient_accumulation_steps() > 1)
            except InfeasibleError as e:
                raise ConfigError(f"protrain: impossible memory budget: {e}") from None
        if self.global_rank == 0 and protrain_config.verbosity >= 1:
            lines = ["ProTrain: enabled; the model is profiled and the plan chosen at the first "
                     "forward pass"]
            if overridden:
                lines.append("ProTrain: the plan replaces these DeepSpeed settings: " + ", ".join(overridden))
            print("\n".join(lines), flush=True)

    # ---- DeepSpeed hooks (private API; see tests/test_ds_contract.py) ---------------------
    def _configure_optimizer(self, client_optimizer, model_parameters):
        self.optimizer = ProTrainOptimizer(self, client_optimizer, model_parameters)
        self.basic_optimizer = self.optimizer.optimizer

    def clip_fp32_gradients(self):
        """Clipping happens in ProTrainOptimizer.step, where the gradients are (in chunks)."""

    def _broadcast_model(self):
        """Every rank starts from rank 0's weights (DeepSpeed does this too). Parameters may
        sit on the host (a model too big for the device): NCCL needs them on the device, so
        they travel through a device copy one at a time."""
        dp = DataParallel()
        if dp.world == 1:
            return
        nccl = torch.distributed.get_backend() == "nccl"
        for p in self.module.parameters():
            t = p.data
            if nccl and t.device.type != "cuda":
                tmp = t.to(self.device)
                torch.distributed.broadcast(tmp, 0)
                t.copy_(tmp)
            else:
                torch.distributed.broadcast(t, 0)

    # ---- training ----------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        if self.protrain_runtime is None:
            self._protrain_setup(inputs, kwargs)
        # What redoing this micro-batch after an out-of-memory error needs.
        self._protrain_redo = (inputs, kwargs, _rng_state())
        try:
            with self.protrain_runtime.forward_context():
                return super().forward(*inputs, **kwargs)
        except torch.OutOfMemoryError as e:
            failure = _without_traceback(e)
        # Re-plan outside the except clause: the exception's traceback holds the failed
        # forward's frames, and through them its activations, until the clause is left.
        self._protrain_replan("forward", failure)
        _set_rng_state(self._protrain_redo[2])
        return self.forward(*inputs, **kwargs)

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        try:
            return super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        except torch.OutOfMemoryError as e:
            failure = _without_traceback(e)
        # The caller still holds ``loss``, and through its graph the activations backward had
        # not reached yet: cut it off so they are freed before the re-plan allocates.
        _drop_graph(loss)
        del loss
        if not self.protrain_runtime.optimizer.can_redo_micro_batch():
            raise RuntimeError(
                "ProTrain: out of device memory in backward after part of this optimizer step "
                "was already applied or accumulated, so the step cannot be redone exactly. "
                "Resume from the last checkpoint with a larger protrain.memory_margin (or "
                "delete protrain.plan_file to re-plan)") from failure
        self._protrain_replan("backward", failure)
        inputs, kwargs, rng = self._protrain_redo
        _set_rng_state(rng)
        loss = self.forward(*inputs, **kwargs)
        return super().backward(_loss_of(loss), retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def _protrain_replan(self, where: str, error: BaseException) -> None:
        """An out-of-memory error in this micro-batch: plan again with a larger memory margin,
        move every state into the new plan's chunks, and let the caller redo the micro-batch.
        Gradients of the failed micro-batch are dropped; those accumulated before it are kept.
        The old runtime's device memory is given back before the new one allocates."""
        from protrain.runtime.states import assemble, export_pieces, import_pieces
        rt = self.protrain_runtime
        dp = rt.chunks.dp
        if dp.world > 1:
            raise RuntimeError("ProTrain: out of device memory with several ranks: re-planning "
                               "needs every rank; restart from the last checkpoint with a larger "
                               "protrain.memory_margin") from error
        planner = _planner_config(self, dp)
        margin = max(planner.memory_margin, self._protrain_margin) + 0.1
        if margin >= 1.0:
            raise InfeasibleError(f"ProTrain: out of device memory again at a {margin - 0.1:.0%} "
                                  f"margin; no plan is safe on this device. Lower the micro-batch "
                                  f"or the sequence length, or use a device with more memory") from error
        self._protrain_margin = margin
        opt = self.optimizer
        while opt._backward_active_depth > 0:       # DeepSpeed's backward never finished
            opt.exit_backward()
        rt.optimizer.worker.drain()
        rt.streams.synchronize()
        keep_grads = self.gradient_accumulation_steps() > 1 and rt.optimizer._dirty_before_forward
        if where == "backward" or not keep_grads:
            rt.optimizer._dirty = True
            rt.optimizer._reset()                     # this micro-batch's partial gradients
        pieces = {}
        for piece in export_pieces(rt.chunks, grads=keep_grads):
            pieces.setdefault(piece.name, []).append(piece)
        # Park every parameter on the host and drop every reference to the old runtime (its
        # chunks, buffers, optimizer states) before the new chunks take the device.
        rt.close(to_host=True)
        self.protrain_runtime = self.optimizer.runtime = None
        del rt
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        profile = self.protrain_profile
        if profile is None:
            inputs, kwargs, rng = self._protrain_redo
            profile = self._profile(find_blocks(self.module)[1], inputs, kwargs)
            _set_rng_state(rng)
            self.protrain_profile = profile
        old = self.protrain_plan
        plan = search(profile, self._hardware(), replace(planner, memory_margin=margin))
        if self.global_rank == 0:
            print(f"ProTrain: out of device memory in {where} ({str(error).splitlines()[0][:120]}); "
                  f"re-planned with a {margin:.0%} margin: {old.knobs.as_tuple()} -> "
                  f"{plan.knobs.as_tuple()}, predicted peak {plan.prediction.peak_device_bytes / 2**30:.2f} "
                  f"GiB; redoing the micro-batch", flush=True)
        if self.protrain_config.plan_file:
            plan.save(self.protrain_config.plan_file)
        self._protrain_build_runtime(plan, dp)
        import_pieces(self.protrain_runtime.chunks, lambda n, lo, hi: assemble(pieces, n, lo, hi),
                      grads=keep_grads)
        self.protrain_runtime.resume_optimizer()
        self.protrain_runtime.optimizer._dirty = keep_grads

    def train_batch(self, data_iter):
        """Run one optimizer step over ``gradient_accumulation_steps`` micro-batches drawn from
        ``data_iter`` (each a tuple/list of positional inputs or a dict of keyword inputs) and
        return the mean loss, as DeepSpeed's PipelineEngine.train_batch does."""
        losses = []
        for _ in range(self.gradient_accumulation_steps()):
            batch = next(data_iter)
            out = self(**batch) if isinstance(batch, dict) else self(*batch)
            loss = _loss_of(out)
            self.backward(loss)
            self.step()
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    def destroy(self):
        """Give the parameters back as plain tensors with their trained values (with several
        ranks, every rank must call it: the shards are gathered)."""
        if self.protrain_runtime is not None:
            self.protrain_runtime.close()
            self.protrain_runtime = None
        super().destroy()

    def __del__(self):
        # Garbage collection runs at different times on different ranks: no collectives here.
        rt = getattr(self, "protrain_runtime", None)
        if rt is not None:
            try:
                rt.close(gather=False)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
            self.protrain_runtime = None
        super().__del__()

    # ---- planning at the first batch --------------------------------------------------------
    def _protrain_setup(self, inputs, kwargs) -> None:
        cfg = self.protrain_config
        verbose = self.global_rank == 0 and cfg.verbosity >= 1
        _, blocks = find_blocks(self.module)
        if getattr(self.module, "is_gradient_checkpointing", False) and \
                hasattr(self.module, "gradient_checkpointing_disable"):
            self.module.gradient_checkpointing_disable()
            if verbose:
                print("ProTrain: turned off the model's own gradient checkpointing: the plan "
                      "decides per block", flush=True)
        for p in self.module.parameters():
            if hasattr(p, "ds_id"):
                raise ConfigError(
                    "the model's parameters are already partitioned by ZeRO-3 (zero.Init): "
                    "ProTrain places parameters itself. Set zero_optimization.stage to 0, 1 or 2 "
                    "(Hugging Face partitions at load time when it sees stage 3)")
        dp = DataParallel()
        planner = _planner_config(self, dp)
        coll_bw = probe_collective(dp, self.device) if dp.world > 1 else 0.0
        t0 = time.perf_counter()
        profile_seconds = 0.0
        plan, loaded, error, failure = None, False, None, None
        if dp.rank == 0:
            # One rank measures and decides; every rank runs the same plan.
            try:
                plan = self._load_plan(planner)
                loaded = plan is not None
                if plan is None:
                    profile = self._profile(blocks, inputs, kwargs)
                    profile_seconds = time.perf_counter() - t0
                    hw = self._hardware()
                    if cfg.ssd_path:
                        from protrain.profile.probe import probe_storage
                        ssd = probe_storage(cfg.ssd_path, self.device)
                        if verbose:
                            print(f"ProTrain: SSD tier at {cfg.ssd_path} via {ssd['backend']}: write "
                                  f"{ssd['nvme_write_bandwidth'] / 1e9:.2f} GB/s, read "
                                  f"{ssd['nvme_read_bandwidth'] / 1e9:.2f} GB/s, "
                                  f"{ssd['nvme_free_bytes'] / 2**30:.1f} GiB free", flush=True)
                        hw = replace(hw, **{k: v for k, v in ssd.items() if k != "backend"})
                    if dp.world > 1:
                        hw = replace(hw, collective_bandwidth=coll_bw,
                                     host_memory=hw.host_memory // _ranks_per_node(dp))
                    plan = search(profile, hw, planner)
                    self.protrain_profile = profile
                    if cfg.plan_file:
                        plan.save(cfg.plan_file)
            except (InfeasibleError, ConfigError) as e:
                error = (type(e).__name__, str(e))
                failure = e
        shared = dp.broadcast_object((plan.to_dict() if plan is not None else None, loaded, error))
        if shared[2] is not None:          # rank 0 could not plan: every rank stops, saying why
            kind, msg = shared[2]
            if kind == "InfeasibleError":
                e = failure if dp.rank == 0 else None
                raise InfeasibleError(f"ProTrain: no plan fits: {msg}",
                                      device_needed=getattr(e, "device_needed", None),
                                      host_needed=getattr(e, "host_needed", None),
                                      micro_batch_fit=getattr(e, "micro_batch_fit", None)) from None
            raise ConfigError(msg)
        plan = plan if dp.rank == 0 else Plan.from_dict(shared[0])
        loaded = shared[1]
        self.protrain_plan = plan
        if verbose:
            print(plan.explain(), flush=True)
            if loaded:
                print(f"ProTrain: plan loaded from {cfg.plan_file} (no profiling or search)", flush=True)
            else:
                print(f"ProTrain: profiling took {profile_seconds:.2f} s, search "
                      f"{plan.search_seconds:.3f} s" + (f"; plan saved to {cfg.plan_file}"
                                                        if cfg.plan_file else ""), flush=True)
        elif self.global_rank == 0 and cfg.verbosity == 0:
            k = plan.knobs
            print(f"ProTrain: plan {k.as_tuple()} predicted {plan.prediction.iter_time:.3f} s/iter, "
                  f"peak {plan.prediction.peak_device_bytes / 2**30:.2f} GiB", flush=True)
        self._protrain_build_runtime(plan, dp)

    def _protrain_build_runtime(self, plan: Plan, dp: DataParallel | None = None) -> None:
        """Put the model's parameters into the plan's chunks and hook up the runtime."""
        _, blocks = find_blocks(self.module)
        self.protrain_plan = plan
        self.protrain_runtime = ProTrainRuntime(
            self.module, blocks, plan, plan.layout(), [r.name for r in plan.params], self.device,
            self.optimizer.runtime_setup(), swap_bytes=plan.block_saved_bytes,
            is_boundary=self.is_gradient_accumulation_boundary,
            accounting=self.protrain_config.accounting, dp=dp or DataParallel(),
            ssd_root=self.protrain_config.ssd_path, ssd_verify=self.protrain_config.ssd_verify,
            ssd_min_bytes=self.protrain_config.ssd_min_bytes)
        self.optimizer.runtime = self.protrain_runtime
        backend = self.protrain_runtime.activations.storage_backend
        if backend and self.global_rank == 0 and self.protrain_config.verbosity >= 1:
            print(f"ProTrain: {plan.knobs.n_ssd} block(s) on NVMe via {backend} in "
                  f"{self.protrain_runtime.activations.rundir.path}", flush=True)

    # ---- checkpoints (DeepSpeed's signatures; see checkpoint.py) ---------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006
                        exclude_frozen_parameters=False):
        from .checkpoint import save
        return save(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        if custom_load_fn is not None:
            raise ConfigError("load_checkpoint(custom_load_fn=...) is not supported with protrain")
        from .checkpoint import load
        return load(self, load_dir, tag, load_optimizer_states=load_optimizer_states,
                    load_lr_scheduler_states=load_lr_scheduler_states,
                    load_module_only=load_module_only)

    def _load_plan(self, planner) -> Plan | None:
        path = self.protrain_config.plan_file
        if not path or not Path(path).exists():
            return None
        try:
            plan = Plan.load(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"protrain.plan_file {path}: cannot read it ({e}); delete it to re-plan") from None
        if not plan.params:
            raise ConfigError(f"protrain.plan_file {path} has no parameter layout (it was made from "
                              f"an analytic profile); delete it to plan from a measured profile")
        named = dict(self.module.named_parameters())
        for rec in plan.params:
            p = named.get(rec.name)
            if p is None or p.numel() != rec.numel:
                raise ConfigError(f"protrain.plan_file {path} was made for another model (parameter "
                                  f"{rec.name} differs); delete it to re-plan")
        need = plan.prediction.peak_device_bytes * (1 + planner.memory_margin)
        if planner.device_memory and need > planner.device_memory:
            raise ConfigError(f"protrain.plan_file {path} needs {need / 2**30:.2f} GiB of device "
                              f"memory, above protrain.device_memory; delete it to re-plan")
        return plan

    def _profile(self, blocks, inputs, kwargs) -> ModelProfile:
        from protrain.profile.tracer import profile_model
        cfg = self.protrain_config
        cache = _profile_cache_path(cfg.profile_cache_dir, self.module, inputs, kwargs, self.device)
        if cache is not None and cache.exists():
            try:
                return ModelProfile.load(cache)
            except (ValueError, KeyError, TypeError):
                pass
        micro_batch, seq = _batch_shape(inputs, kwargs)
        gas = self.gradient_accumulation_steps()

        held = []

        def step(m):
            # What a training step does with the loss: the script keeps it, engine.backward
            # divides it by the accumulation steps and applies the loss scale; so the profiled
            # iteration allocates what a training iteration does.
            held[:] = [_loss_of(m(*inputs, **kwargs))]
            return self.optimizer.scale_if_loss(held[0] / gas)

        profile = profile_model(
            self.module, step, blocks=blocks,
            device=self.device, name=type(self.module).__name__, micro_batch=micro_batch,
            seq_len=seq, progress=cfg.progress and self.global_rank == 0)
        held.clear()
        if cache is not None:
            profile.save(cache)
        return profile

    def _hardware(self):
        from protrain.profile.probe import probe_hardware
        return probe_hardware(self.device, progress=self.protrain_config.verbosity >= 2)


def _planner_config(engine, dp: DataParallel) -> "PlannerConfig":  # noqa: F821
    cfg = engine.protrain_config.planner
    clip = engine.gradient_clipping() or 0.0
    return replace(cfg, grad_accumulation_steps=engine.gradient_accumulation_steps(),
                   cpu_optim_overlap=not (clip > 0 or engine.fp16_enabled()),
                   data_parallel_size=dp.world)


def _ranks_per_node(dp: DataParallel) -> int:
    """Ranks sharing this host's memory (the launcher says; else every rank is local)."""
    return max(1, min(dp.world, int(os.environ.get("LOCAL_WORLD_SIZE", dp.world))))


def _loss_of(out) -> torch.Tensor:
    """The scalar to backpropagate from a model's output: the output itself, its ``loss``
    (Hugging Face), or the first scalar of a tuple; else a stand-in (the mean) so a model that
    returns logits can still be profiled - its loss's own memory is then not measured."""
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor) and o.numel() == 1:
                return o
        out = out[0]
    if isinstance(out, torch.Tensor):
        log.warning("protrain: the model returns no loss; profiling backward from the mean of its "
                    "output (the loss computed outside the model is not measured)")
        return out.float().mean()
    raise TypeError(f"cannot find a loss in the model output ({type(out).__name__}); return the loss "
                    f"or a Hugging Face ModelOutput with .loss from forward")


def _without_traceback(e: BaseException) -> BaseException:
    """The error, as a fresh exception of its type with its message: keeping the original
    would keep its traceback, the failed step's frames and the tensors they hold."""
    try:
        return type(e)(str(e))
    except TypeError:
        return RuntimeError(str(e))


def _drop_graph(loss) -> None:
    """Detach the caller's loss from its autograd graph, which would otherwise keep the failed
    step's activations alive as long as the caller holds the loss."""
    if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
        try:
            loss.detach_()
        except RuntimeError:    # a view: its graph lives until the caller drops it
            log.warning("protrain: the loss is a view of another tensor; the failed backward's "
                        "activations stay alive until the training loop drops its reference")


def _check_ssd_path(path: str) -> None:
    """Refuse an unusable SSD path at initialize (the space needed is checked once the plan is
    known)."""
    from protrain.runtime.storage import RunDirectory, StorageConfigError
    try:
        RunDirectory(path, 0).close()
    except StorageConfigError as e:
        raise ConfigError(f"protrain.ssd_path: {e}") from None


def _rng_state():
    return (torch.random.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _set_rng_state(state) -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _batch_shape(inputs, kwargs) -> tuple[int | None, int | None]:
    for t in list(inputs) + list(kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0]), int(t.shape[1])
    return None, None


def _profile_cache_path(directory, module, inputs, kwargs, device) -> Path | None:
    if not directory:
        return None
    ident = {
        "model": type(module).__name__,
        "params": [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()],
        "inputs": [(k, list(t.shape), str(t.dtype)) for k, t in
                   list(enumerate(inputs)) + list(kwargs.items()) if isinstance(t, torch.Tensor)],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    key = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(directory) / f"profile-{key}.json"

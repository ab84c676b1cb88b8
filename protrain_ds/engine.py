"""ProTrainEngine: a DeepSpeedEngine whose memory is run by a ProTrain plan.

Everything a DeepSpeed script uses stays DeepSpeed's: forward/backward/step, gradient
accumulation, clipping, loss scaling, LR schedulers, global_steps, get_lr, the Hugging Face
integration. What changes:

- the model stays where the user put it (``dont_change_device``): ProTrain places every
  parameter itself, in chunks;
- the optimizer DeepSpeed builds is a ProTrainOptimizer (``_configure_optimizer``);
- the first forward profiles the model on its first batch (or loads a saved plan), searches
  the plan, prints it, and builds the runtime; every forward then runs inside the runtime's
  forward context;
- a batch beyond the shape the plan covers (more samples or tokens: a pad-to-longest collator,
  a curriculum) is planned for before its forward (``_protrain_longer_batch``), all ranks
  together; an out-of-memory error re-plans with a larger margin. Both move every state into
  the new plan's chunks (``_protrain_move``).

- ``engine.compile()`` (and a model compiled before initialize) compiles the blocks once the
  plan is made, not the whole module (``compile.py``).

Private DeepSpeed methods overridden here (checked by tests/test_ds_contract.py):
``_configure_optimizer``, ``clip_fp32_gradients``, ``_broadcast_model``.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine

from protrain.batch_shape import BatchShape, model_max_seq_len, replan_shape
from protrain.config import ConfigError
from protrain.plan import Plan
from protrain.preflight import ModelFacts, check_profile_length, check_settings
from protrain.profile.blocks import find_blocks
from protrain.profile.cache import ProfileCache
from protrain.profile.model_profile import ModelProfile
from protrain.measure.probe import probe_alltoall, probe_collective
from protrain.runtime.collectives import DataParallel, host_side
from protrain.runtime.node import NodeShare, node_share
from protrain.runtime.options import RuntimeOptions
from protrain.runtime.runtime import ProTrainRuntime
from protrain.search import InfeasibleError, check_budgets, search
from protrain.units import fmt_bytes

from . import compile as protrain_compile
from .config import ProTrainDSConfig
from .optimizer import ProTrainOptimizer
from .sequence_parallel import SequenceParallelForward, model_takes, unsupported_reason

log = logging.getLogger("protrain")

SAVE_ON_EVERY_RANK = (
    "Call it on every rank and write on one: trainer.save_model(), accelerator.get_state_dict("
    "model), engine.save_16bit_model(dir) and model.save_pretrained(dir, is_main_process=rank == 0) "
    "on every rank do; or save a checkpoint on every rank (engine.save_checkpoint(DIR)) and export "
    "its weights anywhere later: python -m protrain_ds.checkpoint DIR OUT.pt")
"""What to do when a state_dict of sharded parameters is called on some ranks only."""


class ProTrainEngine(DeepSpeedEngine):
    def __init__(self, *args, protrain_config: ProTrainDSConfig, overridden: list[str],
                 compile_request=None, **kwargs):
        # Set before DeepSpeed's constructor: it calls _configure_optimizer.
        self.protrain_config = protrain_config
        self.protrain_compile = compile_request   # torch.compile asked for (protrain.runtime.compile)
        self.protrain_overridden = overridden
        self.protrain_runtime: ProTrainRuntime | None = None
        self._protrain_overlap = None   # OverlapStats, kept across re-plans
        self.protrain_plan: Plan | None = None
        self.protrain_profile: ModelProfile | None = None
        self._protrain_margin = 0.0
        self._protrain_redo = None
        self._protrain_sp: SequenceParallelForward | None = None
        self._protrain_node = NodeShare(ranks_per_node=1, local_rank=0, cores=1)
        """This rank's share of its host (set at the first forward, when every rank is there)."""
        self._protrain_sp_factor: float | None = None   # the script's loss factor, kept over re-plans
        self._protrain_covered: BatchShape | None = None
        """The largest batch the plan in force was made for (None: not known yet)."""
        self._protrain_second: ModelProfile | None = None   # the profile at half the sequence
        self._protrain_ce_calls = 1
        self._protrain_hw = None
        super().__init__(*args, dont_change_device=True, **kwargs)
        # Every forward agrees on the batch shape over the ranks, in host memory (see host_side).
        self._protrain_host = host_side(DataParallel())
        # Gradients live in chunks, not in .grad: DeepSpeed's own all-reduce has nothing to do.
        self.enable_backward_allreduce = False
        if not isinstance(self.optimizer, ProTrainOptimizer):
            raise ConfigError("ProTrain needs an optimizer to train: add an \"optimizer\" section "
                              "(Adam or AdamW) to the DeepSpeed config or pass one to initialize")
        self._protrain_preflight()
        # An unusable cache directory is reported and ignored.
        self._protrain_cache = ProfileCache(
            protrain_config.profile_cache_dir if self.global_rank == 0 else None,
            key_name="protrain.profile_cache_dir")
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

    def _protrain_preflight(self) -> None:
        """Refuse now what this model and launch cannot run, not at the first forward after
        profiling (protrain/preflight.py). Every rank refuses: a check that can fail on one rank
        only (a path on its host, the plan file rank 0 writes) is shared over the ranks, so
        none goes on to wait in a collective for a peer that stopped."""
        cfg = self.protrain_config
        error = None
        try:
            check_settings(cfg.planner, ModelFacts.of(self.module), world=DataParallel().world,
                           ssd_path=cfg.ssd_path, sp_unsupported=unsupported_reason(self.module),
                           profile_seq_len=cfg.profile_seq_len, max_seq_len=cfg.max_seq_len,
                           model_max=model_max_seq_len(self.module), sp_key=cfg.sequence_parallel_key)
            if cfg.ssd_path:
                _check_ssd_path(cfg.ssd_path)
            if cfg.trace_file:
                _check_trace_file(cfg.trace_file)
            if cfg.plan_file and self.global_rank == 0:    # rank 0 plans: reads and writes it
                _check_plan_file(cfg.plan_file)
        except ConfigError as e:
            error = str(e)
        errors = DataParallel().all_gather_object(error)
        if error is not None:
            raise ConfigError(error)
        for rank, other in enumerate(errors):
            if other is not None:
                raise ConfigError(f"{other} (refused on rank {rank})")

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

    def compile(self, backend=get_accelerator().get_compile_backend(), compile_kwargs={},  # noqa: B006
                schedule=None, compiled_autograd_enabled=False) -> None:
        """DeepSpeed's signature; the blocks are compiled under the plan (compile.py)."""
        protrain_compile.engine_compile(self, backend, compile_kwargs, schedule, compiled_autograd_enabled)

    # ---- training ----------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        kwargs = _no_kv_cache(self.module, kwargs)
        if self.protrain_runtime is None:
            self._protrain_setup(inputs, kwargs, self._protrain_batch(inputs, kwargs))
        elif torch.is_grad_enabled():
            # Training forwards run on every rank; one without autograd (evaluation,
            # generation) may run on one rank alone, so it neither agrees on the shape nor
            # re-plans: it saves no activations for backward, which the plan mostly holds.
            shape = self._protrain_batch(inputs, kwargs)
            if shape is not None and self._protrain_covered is None:
                self._protrain_covered = shape       # a plan that does not say (an older file)
            elif shape is not None and not self._protrain_covered.covers(shape):
                self._protrain_longer_batch(shape, inputs, kwargs)
        if self._protrain_sp is not None:
            return self._protrain_sp.forward(inputs, kwargs)
        # What redoing this micro-batch after an out-of-memory error needs.
        self._protrain_redo = (inputs, kwargs, _rng_state())
        try:
            with self.protrain_runtime.forward_context():
                return super().forward(*inputs, **kwargs)
        except torch.OutOfMemoryError as e:
            failure = _without_traceback(e)
        # Re-plan outside the except clause: the exception's traceback holds the failed
        # forward's frames, and through them its activations, until the clause is left.
        self._protrain_out_of_memory("forward", failure)
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
        self._protrain_out_of_memory("backward", failure)
        inputs, kwargs, rng = self._protrain_redo
        _set_rng_state(rng)
        loss = self.forward(*inputs, **kwargs)
        return super().backward(_loss_of(loss), retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def _protrain_out_of_memory(self, where: str, error: BaseException) -> None:
        """An out-of-memory error in this micro-batch: plan again with a larger memory margin
        and let the caller redo the micro-batch. Gradients of the failed micro-batch are
        dropped; those accumulated before it are kept."""
        dp = self.protrain_runtime.chunks.dp
        if dp.world > 1:
            # The error happened on this rank alone: the others are inside a collective.
            raise RuntimeError("ProTrain: out of device memory with several ranks: re-planning "
                               "needs every rank; restart from the last checkpoint with a larger "
                               "protrain.memory_margin") from error
        margin = max(self.protrain_config.planner.memory_margin, self._protrain_margin) + 0.1
        if margin >= 1.0:
            raise InfeasibleError(f"ProTrain: out of device memory again at a {margin - 0.1:.0%} "
                                  f"margin; no plan is safe on this device. Lower the micro-batch "
                                  f"or the sequence length, or use a device with more memory") from error
        self._protrain_margin = margin
        # Accumulated gradients of earlier micro-batches are kept; a failed backward's are not
        # (can_redo_micro_batch: there were none).
        keep = where == "forward" and self.protrain_runtime.optimizer.holds_accumulated_gradients()
        inputs, kwargs, _ = self._protrain_redo
        old, plan = self._protrain_move(self._protrain_covered, inputs, kwargs, margin=margin,
                                        keep_grads=keep)
        if self.global_rank == 0:
            print(f"ProTrain: out of device memory in {where} ({str(error).splitlines()[0][:120]}); "
                  f"re-planned with a {margin:.0%} margin: {old.knobs.as_tuple()} -> "
                  f"{plan.knobs.as_tuple()}, predicted peak {plan.prediction.peak_device_bytes / 2**30:.2f} "
                  f"GiB; redoing the micro-batch", flush=True)

    def _protrain_longer_batch(self, shape: BatchShape, inputs, kwargs) -> None:
        """A batch beyond the shape the plan covers, on some rank (``shape``: the largest over
        the ranks): plan for it before its forward runs - rounded up (batch_shape.replan_shape)
        so that growing lengths re-plan a handful of times - keeping the gradients accumulated
        so far in this optimizer step."""
        covered = self._protrain_covered
        target = replan_shape(shape, micro_batch=self.train_micro_batch_size_per_gpu(),
                              model_max=model_max_seq_len(self.module)).union(covered)
        margin = max(self.protrain_config.planner.memory_margin, self._protrain_margin)
        keep = self.protrain_runtime.optimizer.holds_accumulated_gradients()
        old, plan = self._protrain_move(target, inputs, kwargs, margin=margin, keep_grads=keep)
        if self.global_rank == 0:
            ranks = f" (the largest of {self._protrain_host.world} ranks')" if self._protrain_host.world > 1 else ""
            p0, p1 = old.knobs.sequence_parallel, plan.knobs.sequence_parallel
            sp = f", sequence_parallel {p0} -> {p1}" if p1 != p0 else ""
            print(f"ProTrain: batch {shape}{ranks} is beyond the plan's {covered}; re-planned for "
                  f"{target}: {old.knobs.as_tuple()} -> {plan.knobs.as_tuple()}{sp}, predicted peak "
                  f"{fmt_bytes(plan.prediction.peak_device_bytes)}"
                  + (f"; saved to {self.protrain_config.plan_file}" if self.protrain_config.plan_file else ""),
                  flush=True)

    def _protrain_move(self, target: BatchShape | None, inputs, kwargs, *, margin: float,
                       keep_grads: bool) -> tuple[Plan, Plan]:
        """Plan again for batches up to ``target`` with ``margin``, and move every state into
        the new plan's chunks: weights, fp32 masters, Adam moments and step counts, and with
        ``keep_grads`` the gradients accumulated in this optimizer step (else they are
        dropped). A collective: every rank calls it, rank 0 plans (profiling ``inputs`` if it
        holds no profile: a loaded plan). The old runtime's memory is given back before the
        new one allocates. Returns (old plan, new plan)."""
        rt = self.protrain_runtime
        dp = rt.chunks.dp
        opt = self.optimizer
        while opt._backward_active_depth > 0:       # DeepSpeed's backward never finished
            opt.exit_backward()
        state = rt.export_state(grads=keep_grads)
        old = self.protrain_plan
        # Park every parameter on the host and drop every reference to the old runtime (its
        # chunks, buffers, optimizer states) before the new chunks take the device.
        rt.close(to_host=True)
        self.protrain_runtime = self.optimizer.runtime = None
        self._protrain_close_sp()
        del rt
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        planner = replace(_planner_config(self, dp), memory_margin=margin)
        if keep_grads and dp.world > 1 and old.knobs.sequence_parallel == 1 and \
                planner.pins.sequence_parallel is None:
            # A plan at P > 1 learns the script's loss factor (sequence_parallel.py) on its
            # first micro-step by rescaling what was accumulated, which would rescale the
            # gradients carried over from P = 1 too: the degree stays for this re-plan.
            planner = replace(planner, pins=replace(planner.pins, sequence_parallel=1))
        plan = self._protrain_choose(inputs, kwargs, dp, planner, target, load=False)[0]
        self._protrain_build_runtime(plan, dp)
        # Another layout or sharding: each rank gets what it holds now.
        self.protrain_runtime.import_state(state, exchange=self._protrain_host)
        return old, self.protrain_plan

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

    def protrain_stats(self) -> dict:
        """What the runtime did so far, for logs and dashboards:

        - ``cpu_adam_overlapped_chunks``: offloaded chunk updates that ran during backward and
          stood (cumulative; with clipping or fp16 they are speculative and committed);
        - ``cpu_adam_rollbacks``: speculative chunk updates undone and redone after backward
          because the step clipped, overflowed or its hyperparameters changed (cumulative);
        - ``cpu_adam_exposed_s``: the last optimizer step's wall time after backward: the
          optimizer work backward did not hide.
        """
        st = self._protrain_overlap
        if st is None:
            raise RuntimeError("protrain_stats(): ProTrain has not planned yet (it plans on the "
                               "first forward); call it after a training step")
        return {"cpu_adam_overlapped_chunks": st.overlapped_chunks,
                "cpu_adam_rollbacks": st.rollbacks, "cpu_adam_exposed_s": st.exposed_s}

    def protrain_sync(self) -> None:
        """Wait for the last step's CPU Adam updates. ``step()`` returns while offloaded chunks
        may still be updating (their updates run into the next forward, whose uploads wait for
        them); state_dict, checkpoints and forward passes wait by themselves. Call this before
        reading offloaded parameters' tensors directly."""
        if self.protrain_runtime is not None:
            self.protrain_runtime.optimizer.sync()

    def destroy(self):
        """Give the parameters back as plain tensors with their trained values (with several
        ranks, every rank must call it: the shards are gathered)."""
        if self.protrain_runtime is not None:
            self.protrain_runtime.close()
            self.protrain_runtime = None
        self._protrain_close_sp()
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
    def _protrain_batch(self, inputs, kwargs) -> BatchShape | None:
        """This forward's batch shape, the largest over the ranks (with pad-to-longest ranks see
        different lengths in one step; all of them must run one plan). One all-reduce of two
        numbers in host memory per forward (collectives.host_side: no device sync)."""
        micro_batch, seq = _batch_shape(inputs, kwargs)
        host = self._protrain_host
        if host.world > 1:
            t = torch.tensor([micro_batch or 0, seq or 0], dtype=torch.int64)
            host.all_reduce_(t, op=dist.ReduceOp.MAX)
            micro_batch, seq = int(t[0]), int(t[1])
        return BatchShape(micro_batch, seq) if micro_batch and seq else None

    def _protrain_first_shape(self, shape: BatchShape | None) -> BatchShape | None:
        """What the first plan covers: this batch, the configured micro-batch, and
        ``max_seq_len`` when given (then longer batches never re-plan)."""
        if shape is None:
            return None
        longest = self.protrain_config.max_seq_len
        if longest == "auto":
            longest = model_max_seq_len(self.module)     # one there: checked at initialize
        return shape.union(BatchShape(self.train_micro_batch_size_per_gpu(), longest or 0))

    def _protrain_setup(self, inputs, kwargs, shape: BatchShape | None) -> None:
        cfg = self.protrain_config
        verbose = self.global_rank == 0 and cfg.verbosity >= 1
        protrain_compile.before_planning(self)
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
        # The ranks on this host: the launcher's variables, else one all-gather of host names.
        self._protrain_node = node_share(dp)
        if dp.world > 1 and not (cfg.plan_file and Path(cfg.plan_file).exists()):
            # Every rank takes part in the probe rank 0 plans with: one process per node
            # measures while the node's others sleep on the probe's lock (waiting in the plan's
            # broadcast instead, NCCL ranks would spin a core each under the measurement).
            self._hardware()
        target = self._protrain_first_shape(shape)
        plan, loaded, profile_seconds = self._protrain_choose(inputs, kwargs, dp, _planner_config(self, dp),
                                                              target, load=True)
        if verbose:
            print(plan.explain(), flush=True)
            if loaded:
                print(f"ProTrain: plan loaded from {cfg.plan_file} (no profiling or search)", flush=True)
            else:
                beyond = f"; planned for batches up to {target}" if target != shape else ""
                print(f"ProTrain: profiling took {profile_seconds:.2f} s, search "
                      f"{plan.search_seconds:.3f} s{beyond}" + (f"; plan saved to {cfg.plan_file}"
                                                               if cfg.plan_file else ""), flush=True)
        elif self.global_rank == 0 and cfg.verbosity == 0:
            k = plan.knobs
            sp = f", sequence_parallel={k.sequence_parallel}" if k.sequence_parallel > 1 else ""
            print(f"ProTrain: plan {k.as_tuple()}{sp} predicted {plan.prediction.iter_time:.3f} s/iter, "
                  f"peak {plan.prediction.peak_device_bytes / 2**30:.2f} GiB", flush=True)
        self._protrain_build_runtime(plan, dp)
        self._protrain_covered = self._protrain_covered or target

    def _protrain_choose(self, inputs, kwargs, dp: DataParallel, planner, target: BatchShape | None,
                         *, load: bool) -> tuple[Plan, bool, float]:
        """The plan every rank runs, for batches up to ``target``: rank 0 loads it from
        ``plan_file`` (with ``load``, if one there covers ``target``) or searches it - from
        its profile, taken now from ``inputs`` if it has none, scaled to ``target`` - and
        saves it; every rank gets it (a collective). Returns (plan, loaded, profiling seconds)."""
        cfg = self.protrain_config
        _, blocks = find_blocks(self.module)
        links = _probe_links(dp, self.device)       # every rank measures
        t0 = time.perf_counter()
        profile_seconds = 0.0
        plan, loaded, error, failure = None, False, None, None
        if dp.rank == 0:
            # One rank measures and decides; every rank runs the same plan.
            try:
                plan = self._load_plan(planner, blocks, target) if load else None
                loaded = plan is not None
                if plan is None:
                    if self.protrain_profile is None:
                        check_profile_length(cfg.profile_seq_len, _batch_shape(inputs, kwargs)[1])
                        self.protrain_profile, self._protrain_ce_calls = self._profile(blocks, inputs, kwargs)
                        profile = self.protrain_profile
                        if dp.world > 1 and profile.seq_len and profile.seq_len >= 2:
                            # Degrees that split the sequence below the profiled length: a
                            # second, shorter profile separates what grows with it from what
                            # does not (protrain.sp.scaling).
                            self._protrain_second = self._profile(blocks, inputs, kwargs,
                                                                  length=profile.seq_len // 2)[0]
                        profile_seconds = time.perf_counter() - t0
                    plan = self._protrain_search(planner, dp, links, target)
                    if cfg.plan_file:
                        plan.save(cfg.plan_file)
            except Exception as e:  # noqa: BLE001 - the peers wait in the broadcast below
                error = (type(e).__name__, str(e))
                failure = e
        shared = dp.broadcast_object((plan.to_dict() if plan is not None else None, loaded, error))
        if shared[2] is not None:          # rank 0 could not plan: every rank stops, saying why
            kind, msg = shared[2]
            if failure is not None and not isinstance(failure, (InfeasibleError, ConfigError)):
                raise failure              # rank 0: its own error, traceback and all
            if kind not in ("InfeasibleError", "ConfigError"):
                raise RuntimeError(f"ProTrain: rank 0 failed while profiling and planning "
                                   f"({kind}: {msg}); see rank 0's traceback")
            if kind == "InfeasibleError":
                e = failure if dp.rank == 0 else None
                raise InfeasibleError(f"ProTrain: no plan fits: {msg}",
                                      device_needed=getattr(e, "device_needed", None),
                                      host_needed=getattr(e, "host_needed", None),
                                      micro_batch_fit=getattr(e, "micro_batch_fit", None)) from None
            raise ConfigError(msg)
        plan = plan if dp.rank == 0 else Plan.from_dict(shared[0])
        return plan, shared[1], profile_seconds

    def _protrain_search(self, planner, dp: DataParallel, links, target: BatchShape | None) -> Plan:
        """Rank 0: the plan for batches up to ``target`` from this engine's profile (scaled to
        ``target`` when it was taken at another shape, and per sequence-parallel degree)."""
        profile = self.protrain_profile
        hw = self._protrain_machine(dp, links)
        if target is None or (dp.world == 1 and (target.micro_batch, target.seq_len) ==
                              (profile.micro_batch, profile.seq_len)):
            return search(profile, hw, planner)
        from protrain.sp.planner import search_sequence_parallel
        why = unsupported_reason(self.module) or (
            None if self._protrain_ce_calls else "the model computes no cross_entropy loss in "
            "forward (pass the labels), which sequence shards need")
        return search_sequence_parallel(profile, hw, planner, seq_len=target.seq_len,
                                        micro_batch=target.micro_batch, unsupported=why,
                                        second=self._protrain_second)

    def _protrain_machine(self, dp: DataParallel, links: tuple[float, float]):
        """Rank 0: the hardware the plans are made for (measured once per engine)."""
        if self._protrain_hw is not None:
            return self._protrain_hw
        cfg = self.protrain_config
        hw = self._hardware()
        if cfg.ssd_path:
            from protrain.measure.probe import probe_storage
            ssd = probe_storage(cfg.ssd_path, self.device)
            if cfg.verbosity >= 1:
                print(f"ProTrain: SSD tier at {cfg.ssd_path} via {ssd['backend']}: write "
                      f"{ssd['nvme_write_bandwidth'] / 1e9:.2f} GB/s, read "
                      f"{ssd['nvme_read_bandwidth'] / 1e9:.2f} GB/s, "
                      f"{fmt_bytes(ssd['nvme_free_bytes'])} free", flush=True)
            hw = replace(hw, **{k: v for k, v in ssd.items() if k != "backend"})
        if dp.world > 1:
            hw = replace(hw, collective_bandwidth=links[0], alltoall_bandwidth=links[1],
                         host_memory=hw.host_memory // hw.ranks_per_node)
        self._protrain_hw = hw
        return hw

    def _protrain_build_runtime(self, plan: Plan, dp: DataParallel | None = None) -> None:
        """Put the model's parameters into the plan's chunks and hook up the runtime (and, with
        P > 1, Ulysses attention in the blocks and the gather-and-rotate forward)."""
        _, blocks = find_blocks(self.module)
        plan = self._protrain_launchable(plan)
        self.protrain_plan = plan
        setup = replace(self.optimizer.runtime_setup(), speculate_chunks=plan.n_speculate,
                        cpu_adam=self.protrain_config.cpu_adam,
                        host_thread=self.protrain_config.host_thread,
                        cpu_adam_threads=self.protrain_config.cpu_adam_threads
                        or self._protrain_node.threads)
        is_boundary = self.is_gradient_accumulation_boundary
        self._protrain_close_sp()
        p = plan.knobs.sequence_parallel
        if p > 1:
            self._protrain_sp = SequenceParallelForward(self, p, blocks)
            self._protrain_sp.factor = self._protrain_sp_factor
            is_boundary = self._protrain_sp.is_boundary
            # The P sub-steps of a micro-batch accumulate like micro-batches (as planned).
            setup = replace(setup, grad_accumulation_steps=setup.grad_accumulation_steps * p)
        cfg = self.protrain_config
        options = RuntimeOptions(
            is_boundary=is_boundary, accounting=cfg.accounting, dp=dp or DataParallel(),
            ssd_root=cfg.ssd_path, ssd_verify=cfg.ssd_verify, ssd_min_bytes=cfg.ssd_min_bytes,
            trace_file=cfg.trace_file, compile=self.protrain_compile,
            gather_timeout_s=cfg.gather_timeout, save_fix=SAVE_ON_EVERY_RANK)
        self.protrain_runtime = ProTrainRuntime(self.module, blocks, plan, self.device, setup, options)
        protrain_compile.announce(self)
        self.optimizer.runtime = self.protrain_runtime
        self._protrain_covered = BatchShape(plan.micro_batch, plan.seq_len) \
            if plan.micro_batch and plan.seq_len else None
        # Counts are cumulative over re-plans: the new runtime goes on counting in the same record.
        self._protrain_overlap = self._protrain_overlap or self.protrain_runtime.optimizer.stats
        self.protrain_runtime.optimizer.stats = self._protrain_overlap
        backend = self.protrain_runtime.activations.storage_choice
        if backend and self.global_rank == 0 and self.protrain_config.verbosity >= 1:
            print(f"ProTrain: {plan.knobs.n_ssd} block(s) on NVMe via {backend} in "
                  f"{self.protrain_runtime.activations.rundir.path}", flush=True)

    def _protrain_close_sp(self) -> None:
        if self._protrain_sp is not None:
            if self._protrain_sp.factor is not None:     # the script's; a new plan keeps it
                self._protrain_sp_factor = self._protrain_sp.factor
            self._protrain_sp.close()
            self._protrain_sp = None

    def _protrain_launchable(self, plan: Plan) -> Plan:
        """``plan`` with a sequence-parallel degree this launch can run: a loaded plan (plan
        file, checkpoint) may come from another world size; a pinned degree wins. The other
        knobs are kept (delete the plan file to re-plan them)."""
        world = DataParallel().world
        p = plan.knobs.sequence_parallel
        pin = self.protrain_config.planner.pins.sequence_parallel
        want = pin if pin is not None else p
        if world % want:
            want = max(d for d in range(1, min(want, world) + 1) if world % d == 0)
        if want == p:
            return plan
        if self.global_rank == 0:
            print(f"ProTrain: the plan was made for sequence_parallel={p}; this launch of {world} "
                  f"rank(s) runs it with sequence_parallel={want}", flush=True)
        return replace(plan, knobs=replace(plan.knobs, sequence_parallel=want))

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

    def _load_plan(self, planner, blocks, target: BatchShape | None) -> Plan | None:
        """The plan in ``plan_file`` if there is one and it was made for this run: the same
        trainable parameters, blocks and dtype (its predictions hold for nothing else),
        otherwise say what changed; and for batches up to ``target`` at least, otherwise None
        (planned again for this run's batches, and saved there)."""
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

        def stale(why: str) -> ConfigError:
            return ConfigError(f"protrain.plan_file {path} does not fit this run: {why}; delete it "
                               f"(or point plan_file at a new path) to re-plan")
        named = dict(self.module.named_parameters())
        trainable = [n for n, p in named.items() if p.requires_grad]
        why = plan.differs_from(
            n_blocks=len(blocks), micro_batch=None, seq_len=None,
            param_bytes=named[trainable[0]].element_size() if trainable else plan.param_bytes)
        if why is not None:
            raise stale(why)
        why = _pins_disagree(plan, planner.pins)
        if why is not None:
            raise stale(why)
        for rec in plan.params:
            p = named.get(rec.name)
            if p is None or p.numel() != rec.numel:
                raise stale(f"it was made for another model (parameter {rec.name} "
                            + ("is not in this one)" if p is None else
                               f"has {rec.numel} elements there, {p.numel()} here)"))
            if not p.requires_grad:
                raise stale(f"parameter {rec.name} is trainable in the plan but frozen in this run "
                            f"(requires_grad=False)")
        planned = {rec.name for rec in plan.params}
        extra = [n for n in trainable if n not in planned]
        if extra:
            raise stale(f"parameters {extra[:3]} are trainable in this run but not in the plan")
        need = plan.prediction.peak_device_bytes * (1 + planner.memory_margin)
        if planner.device_memory and need > planner.device_memory:
            raise ConfigError(f"protrain.plan_file {path} needs {need / 2**30:.2f} GiB of device "
                              f"memory, above protrain.device_memory; delete it to re-plan")
        if target is not None and plan.micro_batch and plan.seq_len and \
                not BatchShape(plan.micro_batch, plan.seq_len).covers(target):
            if self.protrain_config.verbosity >= 1:
                print(f"ProTrain: the plan in {path} was made for batches up to {plan.micro_batch} x "
                      f"{plan.seq_len}, this run's need {target}: planning again (saved there)",
                      flush=True)
            return None
        return plan

    def _profile(self, blocks, inputs, kwargs, length: int | None = None) -> tuple[ModelProfile, int]:
        """The measured profile on this batch, and how many cross_entropy calls its forward
        made (sequence shards need the loss inside the model). At ``length`` or
        ``profile_seq_len`` (or, when the batch's sequence runs out of device memory, at halves
        of it) the first tokens are profiled and protrain.sp.scaling rescales the profile to
        the full sequence."""
        from protrain.measure.profiler import profile_model
        from protrain.sp.batch import LossProbe, truncate
        cfg = self.protrain_config
        micro_batch, seq = _batch_shape(inputs, kwargs)
        length = min(length or cfg.profile_seq_len or seq, seq) if seq else None
        cache = self._protrain_cache.path(self.module, inputs, kwargs, self.device, length)
        cached = self._protrain_cache.load(cache)
        if cached is not None:
            return cached, 1
        gas = self.gradient_accumulation_steps()
        probe = LossProbe()
        while True:
            a, k = truncate(inputs, kwargs, length) if length and length != seq else (inputs, kwargs)
            held = []

            def step(m):
                # What a training step does with the output: the script keeps it (logits
                # included) through backward, engine.backward divides the loss by the
                # accumulation steps and applies the loss scale; so the profiled iteration
                # allocates what a training iteration does.
                with probe:
                    held[:] = [m(*a, **k)]
                return self.optimizer.scale_if_loss(_loss_of(held[0]) / gas)

            try:
                with protrain_compile.eager_profiling(self.protrain_compile):
                    profile = profile_model(
                        self.module, step, blocks=blocks,
                        device=self.device, name=type(self.module).__name__, micro_batch=micro_batch,
                        seq_len=length, progress=cfg.progress and self.global_rank == 0)
                break
            except torch.OutOfMemoryError:
                held.clear()
                if not length or length < 256:
                    raise
                length //= 2
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                print(f"ProTrain: profiling at sequence {length * 2} ran out of device memory; "
                      f"profiling at {length} and scaling to {seq}", flush=True)
        held.clear()
        self._protrain_cache.save(cache, profile)
        return profile, probe.calls

    def _hardware(self, refresh: bool = False):
        """This machine as the planner prices it (``refresh``: measured now, not cached): the
        node's rates, shared by this host's ranks (``HardwareProfile.ranks_per_node``)."""
        from protrain.cost.host_update import host_update_passes, runtime_update_rate
        from protrain.measure.probe import probe_hardware
        from protrain.runtime.runtime import uses_native_kernel
        cfg = self.protrain_config
        hw = probe_hardware(self.device, progress=cfg.verbosity >= 2, refresh=refresh,
                            ranks_per_node=self._protrain_node.ranks_per_node)
        if hw.copy_engines <= 0 and cfg.host_thread:
            # a CPU "device" whose CPU Adam runs on the worker thread: not inline any more
            hw = replace(hw, cpu_adam_thread=True)
        # CPU Adam priced as the runtime runs it: the kernel and the passes around it
        setup = replace(self.optimizer.runtime_setup(), cpu_adam=cfg.cpu_adam)
        dtype = next(p.dtype for p in self.module.parameters() if p.requires_grad)
        passes = host_update_passes(
            fused_kernel=uses_native_kernel(self.device, setup),
            half=dtype in (torch.float16, torch.bfloat16),
            grad_accumulation=self.gradient_accumulation_steps() > 1,
            scaled=(self.gradient_clipping() or 0.0) > 0 or self.fp16_enabled())
        return runtime_update_rate(hw, passes)


def _pins_disagree(plan: Plan, pins) -> str | None:
    """A knob the config pins that the saved plan set otherwise (the loaded plan would run,
    the pin silently ignored). The sequence-parallel degree is left out: a pinned degree is
    applied to a loaded plan (_protrain_launchable)."""
    from protrain.config import ALL
    for key, want in pins.pinned().items():
        if key == "sequence_parallel":
            continue
        have = getattr(plan.knobs, key)
        if want == ALL:
            want = plan.chunks.n_chunks
        if have != want:
            return f"it was made with {key}={have} and protrain.{key} pins {want}"
    return None


def _planner_config(engine, dp: DataParallel) -> "PlannerConfig":  # noqa: F821
    cfg = engine.protrain_config.planner
    clip = engine.gradient_clipping() or 0.0
    return replace(cfg, grad_accumulation_steps=engine.gradient_accumulation_steps(),
                   cpu_optim_overlap=not (clip > 0 or engine.fp16_enabled()),
                   cpu_optim_speculative=clip > 0 or engine.fp16_enabled(),
                   gradient_clipping=clip > 0, data_parallel_size=dp.world)


_LINKS: dict = {}


def _probe_links(dp: DataParallel, device) -> tuple[float, float]:
    """(all-gather, all-to-all) bandwidth between the ranks, measured once per process and
    world (every rank takes part: an engine built again in the same job does not re-measure)."""
    if dp.world == 1:
        return 0.0, 0.0
    key = (dp.world, str(device))
    if key not in _LINKS:
        _LINKS[key] = (probe_collective(dp, device), probe_alltoall(dp, device))
    return _LINKS[key]


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


def _check_trace_file(path: str) -> None:
    """Each iteration's timeline is written there: refuse a path that cannot be written now."""
    from protrain.serde import unwritable
    p = Path(path)
    why = f"{path} is a directory" if p.is_dir() else unwritable(p.parent)
    if why is not None:
        raise ConfigError(f"protrain.trace_file {path}: the timeline could not be written there "
                          f"({why}); point trace_file at a file in a writable directory")


def _check_plan_file(path: str) -> None:
    """Refuse at initialize a plan file that can be neither read nor saved (after profiling
    would be too late to say so)."""
    from protrain.serde import unwritable
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"protrain.plan_file {path} is a directory; give a file path such as "
                          f"{p / 'plan.json'}")
    if p.exists():
        try:
            with open(p, "rb"):
                pass
        except OSError as e:
            raise ConfigError(f"protrain.plan_file {path}: cannot read it ({e.strerror or e}); fix its "
                              f"permissions or point plan_file at another path") from None
        return
    why = unwritable(p.parent)
    if why is not None:
        raise ConfigError(f"protrain.plan_file {path}: the plan chosen at the first forward could "
                          f"not be saved there ({why}); point plan_file at a writable directory")


def _rng_state():
    return (torch.random.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _set_rng_state(state) -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _no_kv_cache(module, kwargs: dict) -> dict:
    """Training forwards of a model that can keep a KV cache (Hugging Face ``use_cache``) run
    without it: a recomputed block would append its keys to the cache again."""
    if module.training and "use_cache" not in kwargs and model_takes(module, "use_cache"):
        return dict(kwargs, use_cache=False)
    return kwargs


def _batch_shape(inputs, kwargs) -> tuple[int | None, int | None]:
    for t in list(inputs) + list(kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0]), int(t.shape[1])
    return None, None

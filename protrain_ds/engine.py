"""ProTrainEngine: a DeepSpeedEngine whose memory is run by a ProTrain plan.

Everything a DeepSpeed script uses stays DeepSpeed's: forward/backward/step, gradient
accumulation, clipping, loss scaling, LR schedulers, global_steps, get_lr, the Hugging Face
integration. What changes:

- the model stays where the user put it (``dont_change_device``): ProTrain places every
  parameter itself, in chunks;
- the optimizer DeepSpeed builds is a ProTrainOptimizer (``_configure_optimizer``);
- the first forward plans (the planning session, protrain.session: profile the model on its
  first batch or load a saved plan, search, print, share over the ranks) and builds the
  runtime; every forward then runs inside the runtime's forward context;
- a batch beyond the shape the plan covers (more samples or tokens: a pad-to-longest collator,
  a curriculum) is planned for before its forward (``_protrain_longer_batch``), all ranks
  together; an out-of-memory error re-plans with a larger margin. The session decides the new
  plan; ``_protrain_move`` moves every state into its chunks.

- ``engine.compile()`` (and a model compiled before initialize) compiles the blocks once the
  plan is made, not the whole module (``compile.py``).

Private DeepSpeed methods overridden here (checked by tests/test_ds_contract.py):
``_configure_optimizer``, ``clip_fp32_gradients``, ``_broadcast_model``.
"""
from __future__ import annotations

import gc
import inspect
import logging
import shutil
import weakref
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine

from protrain.allocator import choose_allocator
from protrain.batch_shape import BatchShape, batch_dims, model_max_seq_len
from protrain.config import ConfigError
from protrain.plan import Plan
from protrain.preflight import ModelFacts, check_max_length, check_profile_length, check_settings
from protrain.profile.blocks import find_blocks, top_level_blocks
from protrain.profile.cache import ProfileCache
from protrain.profile.model_profile import ModelProfile
from protrain.runtime.boundaries import BlockOrderError, position_names
from protrain.runtime.collectives import DataParallel, host_side
from protrain.runtime.host_limits import read_host_limits
from protrain.runtime.node import NodeShare, node_share
from protrain.runtime.options import RuntimeOptions
from protrain.runtime.runtime import ProTrainRuntime
from protrain.runtime.trainable import TrainableChange, signature
from protrain.search import InfeasibleError, check_budgets
from protrain.session import PlanFailure, PlanningSession, PlanningSteps, PlanRanks
from protrain.session.machine import probe_links, with_storage_and_links
from protrain.session.plan_file import check_plan_file, load_plan_file
from protrain.session.profiling import profile_batch
from protrain.session.session import first_target, longer_target, search_for_batches

from . import accumulation
from . import compile as protrain_compile
from . import fragment_api, handover, zero_init
from .config import ProTrainDSConfig
from .optimizer import ProTrainOptimizer
from .sequence_parallel import SequenceParallelForward, model_takes, unsupported_reason
from .trainable import TrainableStates

log = logging.getLogger("protrain")

SAVE_ON_EVERY_RANK = (
    "Call it on every rank and write on one: trainer.save_model(), accelerator.get_state_dict("
    "model), engine.save_16bit_model(dir) and model.save_pretrained(dir, is_main_process=rank == 0) "
    "on every rank do; or save a checkpoint on every rank (engine.save_checkpoint(DIR)) and export "
    "its weights anywhere later: python -m protrain_ds.checkpoint DIR OUT.pt")
"""What to do when a state_dict of sharded parameters is called on some ranks only."""


class ProTrainEngine(DeepSpeedEngine):
    def __init__(self, *args, protrain_config: ProTrainDSConfig, overridden: list[str],
                 compile_request=None, zero_stage: int = 0, **kwargs):
        # Set before DeepSpeed's constructor: it calls _configure_optimizer.
        self.protrain_config = protrain_config
        self.protrain_compile = compile_request   # torch.compile asked for (protrain.runtime.compile)
        self.protrain_overridden = overridden
        self.protrain_zero_stage = zero_stage
        """The ZeRO stage the user's JSON named (the plan replaces it; checkpoints also carry the
        files plain DeepSpeed writes at that stage, for its tools: zero_files.py)."""
        self.protrain_runtime: ProTrainRuntime | None = None
        self._protrain_overlap = None   # OverlapStats, kept across re-plans
        self.protrain_plan: Plan | None = None
        self.protrain_session: PlanningSession | None = None
        self._protrain_redo = None
        self._protrain_sp: SequenceParallelForward | None = None
        self._protrain_node = NodeShare(ranks_per_node=1, local_rank=0, cores=1)
        """This rank's share of its host (set at the first forward, when every rank is there)."""
        self._protrain_sp_factor: float | None = None   # the script's loss factor, kept over re-plans
        self._protrain_covered: BatchShape | None = None
        """The largest batch the plan in force was made for (None: not known yet)."""
        self._protrain_second: ModelProfile | None = None   # the profile at half the sequence
        self._protrain_ce_calls = 1
        self._protrain_links = (0.0, 0.0)     # (all-gather, all-to-all) bandwidth between the ranks
        self._protrain_resume = None
        """Takes a checkpoint's states loaded before the first plan into the runtime the first
        forward builds (checkpoint.load)."""
        self.protrain_retired_by: str | None = None
        """Set when a later engine took this engine's model over (handover.py): every later
        call is refused naming it."""
        self._protrain_lost: str | None = None
        """Why a re-plan failed after closing the runtime (its states lost), else None."""
        self.protrain_by_hand = False
        """The script accumulates gradients by hand with \"gradient_accumulation_steps\": 1
        (``no_sync()`` and its kin, seen at a forward on some rank): plans from then on hold
        accumulators (accumulation.py)."""
        # Expandable segments before DeepSpeed allocates on the device (long sequences
        # fragment the caching allocator); None on CPU or where the user set it.
        self._protrain_allocator = choose_allocator()
        super().__init__(*args, dont_change_device=True, **kwargs)
        # DeepSpeed moves the whole module to the device. ProTrain places the parameters itself
        # (in chunks) and moves the buffers as DeepSpeed would: a model built on the host keeps
        # no BatchNorm statistics or masks there.
        _buffers_to(self.module, self.device)
        _report_engine_device(self.module, self)
        # Every forward agrees on the batch shape over the ranks, in host memory (see host_side).
        self._protrain_host = host_side(DataParallel())
        # Gradients live in chunks, not in .grad: DeepSpeed's own all-reduce has nothing to do.
        self.enable_backward_allreduce = False
        if not isinstance(self.optimizer, ProTrainOptimizer):
            raise ConfigError("ProTrain needs an optimizer to train: add an \"optimizer\" section "
                              "(Adam or AdamW) to the DeepSpeed config or pass one to initialize")
        self._protrain_states = TrainableStates(self.module, self.optimizer.param_groups,
                                                self.optimizer.step_rule)
        """Optimizer states outside the chunks (parameters frozen since they trained) and the
        step counts a change of the trainable set carries (trainable.py)."""
        self._protrain_preflight()
        # An unusable cache directory is reported and ignored.
        self._protrain_cache = ProfileCache(
            protrain_config.profile_cache_dir if self.global_rank == 0 else None,
            key_name="protrain.profile_cache_dir")
        self.protrain_session = PlanningSession(PlanRanks(DataParallel()), self._protrain_steps(),
                                                plan_file=protrain_config.plan_file)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if params:
            try:
                check_budgets(sum(p.numel() for p in params), max(p.numel() for p in params),
                              params[0].element_size(), protrain_config.planner,
                              grad_accumulation=accumulation.planned_steps(self) > 1)
            except InfeasibleError as e:
                raise ConfigError(f"protrain: impossible memory budget: {e}") from None
        # deepspeed.utils.safe_get_full_grad and its kin: answered where ProTrain holds what
        # DeepSpeed returns, refused by name elsewhere, never a silent None.
        fragment_api.attach(self.module, self)
        handover.register(self)
        if self.global_rank == 0 and protrain_config.verbosity >= 1:
            lines = ["ProTrain: enabled; the model is profiled and the plan chosen at the first "
                     "forward pass"]
            if overridden:
                lines.append("ProTrain: the plan replaces these DeepSpeed settings: " + ", ".join(overridden))
            if self._protrain_allocator:
                lines.append(self._protrain_allocator)
            print("\n".join(lines), flush=True)

    def _protrain_preflight(self) -> None:
        """Refuse now what this model and launch cannot run, not at the first forward after
        profiling (protrain/preflight.py). Every rank refuses: a check that can fail on one rank
        only (a path on its host, the plan file rank 0 writes) is shared over the ranks, so
        none goes on to wait in a collective for a peer that stopped."""
        cfg = self.protrain_config
        error = None
        try:
            check_settings(cfg.planner, ModelFacts.of(self.module, cfg.blocks), world=DataParallel().world,
                           ssd_path=cfg.ssd_path, sp_unsupported=unsupported_reason(self.module),
                           profile_seq_len=cfg.profile_seq_len, max_seq_len=cfg.max_seq_len,
                           model_max=model_max_seq_len(self.module), sp_key=cfg.sequence_parallel_key)
            if cfg.ssd_path:
                _check_ssd_path(cfg.ssd_path)
            if cfg.trace_file:
                _check_trace_file(cfg.trace_file)
            if cfg.plan_file and self.global_rank == 0:    # rank 0 plans: reads and writes it
                check_plan_file(cfg.plan_file)
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

    def zero_grad(self):
        """DeepSpeed ZeRO-0's ``engine.zero_grad()`` drops every ``p.grad``: the gradients
        accumulated since the last step (``step()`` calls it too, after the update). ProTrain's
        are in its chunks: dropped there between micro-batches (was a no-op: the next step
        applied them, silently). After the boundary's backward the step's update has begun
        (CPU Adam runs during backward), so there it is refused by name."""
        super().zero_grad()
        self.optimizer.zero_grad()

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
        if self.protrain_retired_by is not None:
            raise handover.retired_error(self, "a forward pass")
        if self._protrain_lost is not None:
            raise RuntimeError(
                f"ProTrain: a re-plan failed after the old plan's runtime was closed "
                f"({self._protrain_lost}), and the optimizer states went with it: training cannot "
                f"go on exactly. Fix the cause and resume from the last checkpoint "
                f"(engine.load_checkpoint)")
        kwargs = _no_kv_cache(self.module, kwargs)
        if self.protrain_runtime is None:
            # A first forward under torch.inference_mode() (an evaluation before training)
            # plans all the same: the chunks it allocates are trained from later.
            # (Whether the script accumulates by hand is read in its own grad mode.)
            by_hand = accumulation.by_hand_now(self)
            with torch.inference_mode(False):
                self._protrain_setup(inputs, kwargs, self._protrain_batch(inputs, kwargs, by_hand))
        elif torch.is_grad_enabled():
            # Training forwards run on every rank; one without autograd (evaluation,
            # generation) may run on one rank alone, so it neither agrees on the shape nor
            # re-plans: it saves no activations for backward, which the plan mostly holds.
            shape = self._protrain_batch(inputs, kwargs)
            change = self.protrain_runtime.trainable_change()
            if change is not None:
                self._protrain_trainable_changed(change, inputs, kwargs)
            if shape is not None and self._protrain_covered is None:
                self._protrain_covered = shape       # a plan that does not say (an older file)
            elif shape is not None and not self._protrain_covered.covers(shape):
                self._protrain_longer_batch(shape, inputs, kwargs)
            if self.protrain_by_hand and self.protrain_runtime.optimizer.gas == 1:
                self._protrain_accumulate_by_hand(inputs, kwargs)
        if self._protrain_sp is not None:
            return self._protrain_sp.forward(inputs, kwargs)
        # What redoing this micro-batch after an out-of-memory error needs.
        self._protrain_redo = (inputs, kwargs, _rng_state())
        try:
            with self.protrain_runtime.forward_context(inputs, kwargs):
                return super().forward(*inputs, **kwargs)
        except torch.OutOfMemoryError as e:
            failure = _without_traceback(e)
        # Re-plan outside the except clause: the exception's traceback holds the failed
        # forward's frames, and through them its activations, until the clause is left.
        self._protrain_out_of_memory("forward", failure)
        _set_rng_state(self._protrain_redo[2])
        return self.forward(*inputs, **kwargs)

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        if self.protrain_retired_by is not None:
            raise handover.retired_error(self, "engine.backward()")
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
        dropped; those accumulated before it are kept. With several ranks it raises: the error
        happened on this rank alone, the others are inside a collective."""
        margin = self.protrain_session.margin_after_oom(self.protrain_config.planner.memory_margin, error)
        # Accumulated gradients of earlier micro-batches are kept; a failed backward's are not
        # (can_redo_micro_batch: there were none).
        keep = where == "forward" and self.protrain_runtime.optimizer.holds_accumulated_gradients()
        inputs, kwargs, _ = self._protrain_redo
        old, plan = self._protrain_move(self._protrain_covered, inputs, kwargs, margin=margin,
                                        keep_grads=keep)
        self.protrain_session.say_out_of_memory(where, error, old, plan)

    def _protrain_accumulate_by_hand(self, inputs, kwargs) -> None:
        """The script accumulates by hand (accumulation.py) and the runtime has no
        accumulators: plan again with them, before this micro-batch's forward, while no
        gradient of the step exists (else refused: they left the device as the step's)."""
        from protrain.runtime.optimizer import StepState
        if self.protrain_runtime.optimizer.step_state is not StepState.IDLE:
            accumulation.refuse_mixed(self)
        margin = max(self.protrain_config.planner.memory_margin, self.protrain_session.margin)
        old, plan = self._protrain_move(self._protrain_covered, inputs, kwargs, margin=margin,
                                        keep_grads=False)
        self.protrain_session.say_accumulation_by_hand(old, plan)

    @contextmanager
    def no_sync(self):
        """DeepSpeed's, with its check on the JSON's ZeRO stage (accumulation.py)."""
        accumulation.check_no_sync(self)
        with super().no_sync():
            yield

    @contextmanager
    def coalesce_grad_reduction(self):
        """DeepSpeed's (ZeRO 1-3): the backwards inside accumulate; ``step()`` after the block
        applies their sum (accumulation.py)."""
        with accumulation.coalesce_grad_reduction(self):
            yield

    def _protrain_longer_batch(self, shape: BatchShape, inputs, kwargs) -> None:
        """A batch beyond the shape the plan covers, on some rank (``shape``: the largest over
        the ranks): plan for it before its forward runs - rounded up (batch_shape.replan_shape)
        so that growing lengths re-plan a handful of times - keeping the gradients accumulated
        so far in this optimizer step."""
        covered = self._protrain_covered
        target = longer_target(shape, covered, micro_batch=self.train_micro_batch_size_per_gpu(),
                               model_max=model_max_seq_len(self.module))
        margin = max(self.protrain_config.planner.memory_margin, self.protrain_session.margin)
        keep = self.protrain_runtime.optimizer.holds_accumulated_gradients()
        old, plan = self._protrain_move(target, inputs, kwargs, margin=margin, keep_grads=keep)
        self.protrain_session.say_longer_batch(shape, covered, target, old, plan,
                                               world=self._protrain_host.world)

    def _protrain_move(self, target: BatchShape | None, inputs, kwargs, *, margin: float,
                       keep_grads: bool, trainable: set[str] | None = None) -> tuple[Plan, Plan]:
        """Plan again for batches up to ``target`` with ``margin``, and move every state into
        the new plan's chunks: weights, fp32 masters, Adam moments and step counts, and with
        ``keep_grads`` the gradients accumulated in this optimizer step (else they are
        dropped). A collective: every rank calls it, rank 0 plans (profiling ``inputs`` if it
        holds no profile: a loaded plan). The old runtime's memory is given back before the
        new one allocates. ``trainable``: the parameters that train now, when that set changed
        (profiled again; states carried as trainable.py says). Returns (old plan, new plan)."""
        rt = self.protrain_runtime
        dp = rt.chunks.dp
        opt = self.optimizer
        while opt._backward_active_depth > 0:       # DeepSpeed's backward never finished
            opt.exit_backward()
        steps = rt.step_counts()
        state = rt.export_state(grads=keep_grads)
        # The state file stays on the drive (``state`` maps it) until the new runtime has its
        # states: the re-plan is priced with that space taken.
        held = rt.chunks.nvme.file_bytes() if rt.chunks.nvme is not None else 0
        if trainable is not None:
            state = self._protrain_states.carry(state, steps, trainable, rank0=dp.rank == 0,
                                                half=rt.chunks.half)
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
        if trainable is not None:
            # Frozen now: outside every chunk, where the forward runs (closing left them on the host).
            named = self._protrain_states.params
            for name in set(steps) - trainable:
                named[name].data = named[name].data.to(self.device)
        planner = replace(_planner_config(self, dp), memory_margin=margin)
        try:
            plan = self.protrain_session.replan(planner, target, old=old, keep_grads=keep_grads,
                                                batch=(inputs, kwargs), remeasure=trainable is not None,
                                                drive_held=held)
            self._protrain_build_runtime(plan, dp)
            self._protrain_covered = self._protrain_covered or target   # a plan without a sequence
            # Another layout or sharding: each rank gets what it holds now.
            self.protrain_runtime.import_state(state, exchange=self._protrain_host)
        except BaseException as e:
            # The states live only in ``state`` now: a later forward must not plan afresh from
            # zero moments as if this were the first one.
            self._protrain_lost = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            raise
        return old, self.protrain_plan

    def _protrain_trainable_changed(self, change: TrainableChange, inputs, kwargs) -> None:
        """``requires_grad`` changed since the chunks were built (on every rank alike: the
        forward's shape agreement compares the sets): move to chunks built for the parameters
        that train now, profiled again, each state carried as plain DeepSpeed keeps it
        (trainable.py). Refused, before anything moves, where no layout can train it exactly."""
        gas = self.gradient_accumulation_steps()
        if self.micro_steps % gas or self.protrain_runtime.optimizer.holds_accumulated_gradients():
            where = (f"this forward is micro-batch {self.micro_steps % gas + 1} of {gas}" if gas > 1
                     else "gradients of earlier micro-batches, accumulated by hand, are held")
            raise RuntimeError(
                f"ProTrain: requires_grad changed ({change.describe()}) between micro-batches of one "
                f"optimizer step ({where}): the step's gradients were accumulated for the parameters "
                f"that trained before. Change requires_grad after the engine.step() that ends an "
                f"optimizer step (the micro-batch for which engine.is_gradient_accumulation_boundary() "
                f"is true)")
        states = self._protrain_states
        trainable = {n for n, p in states.params.items() if p.requires_grad}
        outside = sorted(trainable - states.held())
        if outside:
            raise ConfigError(
                f"ProTrain: parameters {outside[:3]} train now (requires_grad=True) but are in no "
                f"param group of the optimizer (it was built before they were unfrozen): plain "
                f"DeepSpeed computes their gradients and never updates them. Freeze them again, or "
                f"build the optimizer over them (model_parameters=model.parameters())")
        if not trainable:
            raise ConfigError(f"ProTrain: requires_grad changed ({change.describe()}) and no "
                              f"parameter trains now; keep at least one trainable, or run the "
                              f"forward under torch.no_grad()")
        states.group_steps(self.protrain_runtime.step_counts(), trainable)     # may refuse
        self._protrain_preflight()           # the pins against the new set (chunk_size), all ranks
        margin = max(self.protrain_config.planner.memory_margin, self.protrain_session.margin)
        old, plan = self._protrain_move(self._protrain_covered, inputs, kwargs, margin=margin,
                                        keep_grads=False, trainable=trainable)
        self.protrain_session.say_trainable_changed(change.describe(), len(trainable), old, plan)

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
        - ``reductions_overlapped``: persistent chunks' gradient all-reduces (several ranks)
          started during backward as the chunk's backward ended (cumulative);
        - ``cpu_adam_rollbacks``: speculative chunk updates undone and redone after backward
          because the step clipped, overflowed or its hyperparameters changed (cumulative);
        - ``cpu_adam_exposed_s``: the CPU Adam work the last optimizer step's compute did not
          hide: its forward's and backward's waits for updates the step before carried over,
          plus its ``step()``'s wall time;
        - ``host_state_bytes``: offloaded chunks' optimizer states resident in host memory now
          (with their speculation backups and the staging buffers of the states on NVMe);
        - ``nvme_state_bytes``: optimizer states on the drive (``n_nvme`` chunks' current copy;
          ``nvme_file_bytes``: the file holding them, two places per chunk).
        """
        st = self._protrain_overlap
        if st is None:
            raise RuntimeError("protrain_stats(): ProTrain has not planned yet (it plans on the "
                               "first forward); call it after a training step")
        out = {"cpu_adam_overlapped_chunks": st.overlapped_chunks,
               "cpu_adam_rollbacks": st.rollbacks, "cpu_adam_exposed_s": st.exposed_s,
               "reductions_overlapped": st.reductions_overlapped}
        if self.protrain_runtime is not None:
            out.update(self.protrain_runtime.state_bytes())
        return out

    def protrain_sync(self) -> None:
        """Wait for the last step's CPU Adam updates. ``step()`` returns while offloaded chunks
        may still be updating (their updates run into the next forward, whose uploads wait for
        them); state_dict, checkpoints and forward passes wait by themselves. Call this before
        reading offloaded parameters' tensors directly."""
        if self.protrain_runtime is not None:
            self.protrain_runtime.optimizer.sync()

    def protrain_retire(self, by: str) -> None:
        """Another engine is being built on this model (handover.py): finish the queued host
        updates, give the parameters back as plain tensors holding their current values
        (gathered over the ranks: every rank builds the newcomer), and refuse every later call
        naming ``by``."""
        if self.protrain_runtime is not None:
            self.protrain_runtime.close()
            self.protrain_runtime = None
            self.optimizer.runtime = None
        self._protrain_close_sp()
        fragment_api.detach(self.module)
        self.protrain_retired_by = by

    def destroy(self):
        """Give the parameters back as plain tensors with their trained values (with several
        ranks, every rank must call it: the shards are gathered)."""
        if self.protrain_runtime is not None:
            self.protrain_runtime.close()
            self.protrain_runtime = None
        self._protrain_close_sp()
        fragment_api.detach(self.module)
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
    def _protrain_batch(self, inputs, kwargs, by_hand: bool | None = None) -> BatchShape | None:
        """This forward's batch shape, the largest over the ranks (with pad-to-longest ranks see
        different lengths in one step; all of them must run one plan). One all-reduce of two
        numbers in host memory per forward (collectives.host_side: no device sync). A batch
        without a sequence dimension (batch_shape.batch_dims) has the micro-batch alone.
        ``by_hand``: whether this micro-batch accumulates by hand (None: read now), agreed
        over the ranks into ``protrain_by_hand``."""
        micro_batch, seq = batch_dims(inputs, kwargs)
        by_hand = accumulation.by_hand_now(self) if by_hand is None else by_hand
        host = self._protrain_host
        if host.world > 1:
            # The trainable set's digest rides along (max of it and of its negation): every rank
            # must move to a layout for the same set at the same forward. So does accumulation by
            # hand: one rank seeing it re-plans them all.
            sig = signature(tuple(p.requires_grad for p in self._protrain_states.params.values()))
            t = torch.tensor([micro_batch or 0, seq or 0, sig, -sig, int(by_hand)], dtype=torch.int64)
            host.all_reduce_(t, op=dist.ReduceOp.MAX)
            micro_batch, seq, by_hand = int(t[0]), int(t[1]), bool(t[4])
            if int(t[2]) != -int(t[3]):
                self._protrain_ranks_disagree()
        self.protrain_by_hand = self.protrain_by_hand or by_hand
        return BatchShape(micro_batch, seq or None) if micro_batch else None

    def _protrain_ranks_disagree(self) -> None:
        """The ranks train different parameter sets at this forward (every rank is here): say
        which, on every rank."""
        mine = sorted(n for n, p in self._protrain_states.params.items() if p.requires_grad)
        sets = self._protrain_host.all_gather_object(mine)
        diff = sorted(set().union(*map(set, sets)) - set.intersection(*map(set, sets)))
        ranks = [r for r, names in enumerate(sets) if diff[0] in names] if diff else []
        raise ConfigError(
            f"ProTrain: the ranks train different parameters at this forward ({diff[:3]} has "
            f"requires_grad=True on ranks {ranks} only): every rank must set requires_grad alike, "
            f"at the same step")

    def _protrain_setup(self, inputs, kwargs, shape: BatchShape | None) -> None:
        if self._protrain_resume is not None:
            self._protrain_resume.check()     # a loaded checkpoint still fits, before planning
        cfg = self.protrain_config
        verbose = self.global_rank == 0 and cfg.verbosity >= 1
        protrain_compile.before_planning(self)
        if getattr(self.module, "is_gradient_checkpointing", False) and \
                hasattr(self.module, "gradient_checkpointing_disable"):
            self.module.gradient_checkpointing_disable()
            if verbose:
                print("ProTrain: turned off the model's own gradient checkpointing: the plan "
                      "decides per block", flush=True)
        zero_init.check_plain(self.module)
        dp = DataParallel()
        # The ranks on this host: the launcher's variables, else one all-gather of host names.
        self._protrain_node = node_share(dp)
        # The first plan covers ``max_seq_len`` too when given (then longer batches never re-plan).
        longest = cfg.max_seq_len
        if longest == "auto":
            longest = model_max_seq_len(self.module)     # one there: checked at initialize
        check_max_length(cfg.max_seq_len, shape)
        target = first_target(shape, self.train_micro_batch_size_per_gpu(), longest)
        plan = self.protrain_session.first_plan(_planner_config(self, dp), shape, target,
                                                verbosity=cfg.verbosity, probe=self._hardware,
                                                batch=(inputs, kwargs))
        self._protrain_build_runtime(plan, dp)
        self._protrain_covered = self._protrain_covered or target
        if self._protrain_resume is not None:
            resume, self._protrain_resume = self._protrain_resume, None
            resume.take()

    def protrain_resume_from(self, resume) -> None:
        """``resume`` (checkpoint.Resume): a checkpoint's states, loaded before the runtime
        exists, for the runtime the next forward plans and builds for this job."""
        self._protrain_resume = resume

    # ---- the planning session's steps, as DeepSpeed runs them (protrain.session) -------------
    def _protrain_steps(self) -> PlanningSteps:
        cfg = self.protrain_config
        return PlanningSteps(
            load=lambda planner, target: load_plan_file(
                cfg.plan_file, self.module, len(self._protrain_blocks()), planner, target,
                verbose=cfg.verbosity >= 1, block_sets=self._protrain_block_sets()),
            measure=self._protrain_measure, machine=self._protrain_machine,
            search=self._protrain_search, word=_rank0_failure, together=self._protrain_probe_links,
            host=lambda: read_host_limits(ranks_per_node=self._protrain_node.ranks_per_node),
            ssd_path=cfg.ssd_path,
            drive_free=(lambda: shutil.disk_usage(cfg.ssd_path).free) if cfg.ssd_path else None)

    def _protrain_block_tries(self) -> list[list]:
        """The blocks to plan with, finest first: the model's list; unless protrain.blocks
        names it, coarser ones for where a block of it runs twice in a forward."""
        tries = [self._protrain_blocks()]
        if self.protrain_config.blocks is None:
            top = [m for _, m in top_level_blocks(self.module)]
            tries += [top, []] if {id(m) for m in top} != {id(m) for m in tries[0]} else [[]]
        return tries

    def _protrain_block_sets(self) -> list[list[str]]:
        """``_protrain_block_tries`` by qualified name (what a plan file may name)."""
        return [position_names(self.module, blocks) for blocks in self._protrain_block_tries()]

    def _protrain_blocks(self, plan: Plan | None = None) -> list:
        """The model's blocks: those ``plan`` was made for (Plan.blocks, in the order they run),
        else protrain.blocks' list, else the list found (checked at initialize)."""
        key = self.protrain_config.blocks
        if plan is None or plan.blocks is None:
            return find_blocks(self.module, key)[1]
        # Every name of a module listed at several positions (shared weights) is a position's.
        modules = dict(self.module.named_modules(remove_duplicate=False))
        missing = [n for n in plan.blocks if n not in modules]
        if missing:
            raise ConfigError(f"ProTrain: the plan (protrain.plan_file, or the checkpoint's) was made "
                              f"for blocks this model does not have ({', '.join(missing[:3])}); "
                              f"delete the plan file to plan again")
        if key is not None:
            want = sorted(position_names(self.module, find_blocks(self.module, key)[1]))
            if want != sorted(plan.blocks):
                raise ConfigError(f"protrain.blocks = {key!r}: the plan (protrain.plan_file, or the "
                                  f"checkpoint's) was made for other blocks ({', '.join(plan.blocks[:3])}"
                                  f"{', ...' if len(plan.blocks) > 3 else ''}); delete the plan file "
                                  f"to plan again, or set protrain.blocks as it was")
        return [modules[n] for n in plan.blocks]

    @property
    def protrain_profile(self) -> ModelProfile | None:
        """The profile the plan was searched from (rank 0; None before planning or for a loaded plan)."""
        return self.protrain_session.profile if self.protrain_session is not None else None

    def _protrain_probe_links(self) -> None:
        """Every rank: the links between the ranks, measured once per process (the machine's)."""
        self._protrain_links = probe_links(DataParallel(), self.device)

    def _protrain_measure(self, batch) -> ModelProfile:
        """Rank 0: the profile of the batch (``(inputs, kwargs)``), and with several ranks a
        second one at half its sequence: degrees that split the sequence below the profiled
        length need it to separate what grows with the sequence from what does not
        (protrain.sp.scaling). A batch without a sequence has no second profile."""
        inputs, kwargs = batch
        check_profile_length(self.protrain_config.profile_seq_len, batch_dims(inputs, kwargs)[1])
        profile, blocks = self._protrain_profile_blocks(inputs, kwargs)
        if DataParallel().world > 1 and profile.seq_len and profile.seq_len >= 2:
            self._protrain_second = self._profile(blocks, inputs, kwargs, length=profile.seq_len // 2)[0]
        return profile

    def _protrain_profile_blocks(self, inputs, kwargs) -> tuple[ModelProfile, list]:
        """Rank 0: the profile with the model's blocks, or where one of them runs twice in a
        forward (a layer applied in a loop, shared weights) and protrain.blocks does not name
        them, with coarser ones: the top-level modules, else none (the whole model one part).
        The profile's block parts name the modules in the order they ran (Plan.blocks)."""
        cfg = self.protrain_config
        tries = self._protrain_block_tries()
        for k, blocks in enumerate(tries):
            try:
                profile, self._protrain_ce_calls = self._profile(blocks, inputs, kwargs)
                return profile, blocks
            except BlockOrderError as e:
                if cfg.blocks is not None:
                    raise ConfigError(f"protrain.blocks = {cfg.blocks!r}: {e}") from None
                if cfg.verbosity >= 1:
                    coarser = (f"the {len(tries[k + 1])} top-level modules as blocks" if tries[k + 1]
                               else "no blocks (the whole model one part)")
                    print(f"{e.what}: planning with {coarser} instead", flush=True)
        raise AssertionError("a model without blocks runs no block twice")

    def _protrain_machine(self):
        """Rank 0: the hardware the plans are made for (the session asks once)."""
        cfg = self.protrain_config
        return with_storage_and_links(self._hardware(), device=self.device, ssd_path=cfg.ssd_path,
                                      world=DataParallel().world, links=self._protrain_links,
                                      verbose=cfg.verbosity >= 1)

    def _protrain_search(self, profile: ModelProfile, hw, planner, target: BatchShape | None) -> Plan:
        """Rank 0: the plan for batches up to ``target`` (per sequence-parallel degree with
        several ranks, as far as the model can be split over the sequence)."""
        why = unsupported_reason(self.module) or (
            None if self._protrain_ce_calls else "the model computes no cross_entropy loss in "
            "forward (pass the labels), which sequence shards need")
        plan = search_for_batches(profile, hw, planner, target, world=DataParallel().world,
                                  second=self._protrain_second, unsupported=why)
        return replace(plan, blocks=tuple(part.name for part in profile.blocks))

    def _protrain_build_runtime(self, plan: Plan, dp: DataParallel | None = None) -> None:
        """Put the model's parameters into the plan's chunks and hook up the runtime (and, with
        P > 1, Ulysses attention in the blocks and the gather-and-rotate forward)."""
        blocks = self._protrain_blocks(plan)
        plan = self._protrain_launchable(plan)
        self.protrain_plan = plan
        setup = replace(self.optimizer.runtime_setup(), speculate_chunks=plan.n_speculate,
                        cpu_adam=self.protrain_config.cpu_adam,
                        host_thread=self.protrain_config.host_thread,
                        cpu_adam_threads=self.protrain_config.cpu_adam_threads
                        or self._protrain_node.threads)
        is_boundary = lambda: accumulation.is_boundary(self)  # noqa: E731
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
            gather_timeout_s=cfg.gather_timeout, save_fix=SAVE_ON_EVERY_RANK,
            outside_forward=self._protrain_sp.outside_forward if self._protrain_sp is not None else None)
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
        nvme = self.protrain_runtime.chunks.nvme
        if nvme is not None and self.global_rank == 0 and self.protrain_config.verbosity >= 1:
            print(f"ProTrain: optimizer states of {plan.knobs.n_nvme} offloaded chunk(s) on NVMe "
                  f"({nvme.describe()}) via {nvme.backend} in {nvme.rundir.path}", flush=True)

    def _protrain_close_sp(self) -> None:
        if self._protrain_sp is not None:
            if self._protrain_sp.factor is not None:     # the script's; a new plan keeps it
                self._protrain_sp_factor = self._protrain_sp.factor
            self._protrain_sp.close()
            self._protrain_sp = None

    def _protrain_launchable(self, plan: Plan) -> Plan:
        """``plan`` with a sequence-parallel degree this launch can run: a loaded plan (plan
        file, checkpoint) may come from another world size; a pinned degree wins. The other
        knobs are kept (delete the plan file to re-plan them), but where the optimizer states
        live is this machine's (``_protrain_states_here``)."""
        plan = self._protrain_states_here(plan)
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

    def _protrain_states_here(self, plan: Plan) -> Plan:
        """A loaded plan's ``n_nvme`` as this launch can run it: a pinned n_nvme wins (within
        the plan's offloaded chunks), and without an ssd_path no states go to a drive (a
        checkpoint saved with states on NVMe resumes on a machine without one)."""
        have = plan.knobs.n_nvme
        pin = self.protrain_config.planner.pins.n_nvme
        offloaded = max(0, plan.chunks.n_chunks - plan.knobs.n_persist)
        want = min(pin, offloaded) if pin is not None else have
        if not self.protrain_config.ssd_path:
            want = 0
        if want == have:
            return plan
        if self.global_rank == 0:
            print(f"ProTrain: the plan keeps the optimizer states of {have} chunk(s) on NVMe; this "
                  f"launch keeps {want} there (protrain.n_nvme, protrain.ssd_path)", flush=True)
        return replace(plan, knobs=replace(plan.knobs, n_nvme=want))

    # ---- checkpoints (DeepSpeed's signatures; see checkpoint.py) ---------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006
                        exclude_frozen_parameters=False):
        if self.protrain_retired_by is not None:
            raise handover.retired_error(self, "save_checkpoint()")
        from .checkpoint import save
        return save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        if self.protrain_retired_by is not None:
            raise handover.retired_error(self, "load_checkpoint()")
        if custom_load_fn is not None:
            raise ConfigError("load_checkpoint(custom_load_fn=...) is not supported with protrain")
        from .checkpoint import load
        return load(self, load_dir, tag, load_optimizer_states=load_optimizer_states,
                    load_lr_scheduler_states=load_lr_scheduler_states,
                    load_module_only=load_module_only)

    # ---- ZeRO-3's weight export, for callers that read the JSON's stage 3 -----------------
    def zero_gather_16bit_weights_on_model_save(self):
        """ProTrain's state_dict always gathers the full weights (every rank calls it), so
        accelerate's get_state_dict and the Trainer's save_model, which ask this when the JSON
        says ZeRO stage 3, get them (DeepSpeed's answer, false by default, sent them to
        zero_to_fp32 with no weights written)."""
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """The full state_dict in the training dtype on the host, as ZeRO-3's consolidation
        gives it (called on every rank)."""
        state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        return {k: v.detach().cpu() for k, v in state.items()}

    def _profile(self, blocks, inputs, kwargs, length: int | None = None) -> tuple[ModelProfile, int]:
        """The measured profile on this batch, and how many cross_entropy calls its forward
        made; at ``length`` or ``profile_seq_len`` the first tokens only (protrain.session.profiling)."""
        cfg = self.protrain_config
        gas = self.gradient_accumulation_steps()
        # engine.backward divides the loss by the accumulation steps and applies the loss scale.
        return profile_batch(
            self.module, blocks, inputs, kwargs, shape=batch_dims(inputs, kwargs), device=self.device,
            cache=self._protrain_cache, loss_of=lambda out: self.optimizer.scale_if_loss(_loss_of(out) / gas),
            length=length or cfg.profile_seq_len, progress=cfg.progress and self.global_rank == 0,
            head_tiling=cfg.planner.pins.head_tile != 0, mlp_tiling=cfg.planner.pins.mlp_tile != 0,
            eager=lambda: protrain_compile.eager_profiling(self.protrain_compile))

    def _hardware(self, refresh: bool = False):
        """This machine as the planner prices it (``refresh``: measured now, not cached): the
        node's rates, shared by this host's ranks (``HardwareProfile.ranks_per_node``)."""
        from protrain.cost.host_update import backup_as_run, host_update_passes, runtime_update_rate
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
        native = uses_native_kernel(self.device, setup)
        scaled = (self.gradient_clipping() or 0.0) > 0 or self.fp16_enabled()
        passes = host_update_passes(
            fused_kernel=native, half=dtype in (torch.float16, torch.bfloat16),
            grad_accumulation=accumulation.planned_steps(self) > 1, scaled=scaled)
        return runtime_update_rate(backup_as_run(hw, native=native, speculates=scaled), passes)


def _planner_config(engine, dp: DataParallel) -> "PlannerConfig":  # noqa: F821
    cfg = engine.protrain_config.planner
    clip = engine.gradient_clipping() or 0.0
    return replace(cfg, grad_accumulation_steps=accumulation.planned_steps(engine),
                   cpu_optim_overlap=not (clip > 0 or engine.fp16_enabled()),
                   cpu_optim_speculative=clip > 0 or engine.fp16_enabled(),
                   gradient_clipping=clip > 0, data_parallel_size=dp.world)


def _rank0_failure(failure: PlanFailure) -> BaseException:
    """Rank 0's error while profiling and planning, as every rank raises it: no plan fits or
    a setting cannot work, said on every rank; anything else raised on rank 0 with its
    traceback, and named on the others."""
    if failure.own is not None and not isinstance(failure.own, (InfeasibleError, ConfigError)):
        return failure.own
    if failure.kind not in ("InfeasibleError", "ConfigError"):
        return RuntimeError(f"ProTrain: rank 0 failed while profiling and planning "
                            f"({failure.kind}: {failure.message}); see rank 0's traceback")
    if failure.kind == "InfeasibleError":
        return failure.infeasible(f"ProTrain: no plan fits: {failure.message}")
    return ConfigError(failure.message)


_SAID_NO_LOSS = False


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
        global _SAID_NO_LOSS
        if not _SAID_NO_LOSS:       # once: the profiler runs the model several times
            _SAID_NO_LOSS = True
            log.warning("protrain: the model returns no loss; profiling backward from the mean "
                        "of its output (the loss computed outside the model is not measured)")
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


def _rng_state():
    return (torch.random.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _set_rng_state(state) -> None:
    from .checkpoint import set_cuda_rng_states      # the visible devices' states only
    torch.random.set_rng_state(state[0])
    set_cuda_rng_states(state[1])


_DEVICE_OF: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
"""The engine (weakly) whose device each module with a ``device`` property reports."""


def _report_engine_device(module: torch.nn.Module, engine) -> None:
    """Make ``device`` of ``module`` and its submodules that have that property (a Hugging Face
    PreTrainedModel: the device of its first parameter) answer ``engine.device`` while the
    engine's runtime holds the parameters. ``generate()`` and user code put inputs on
    ``model.device``, and a parameter of an offloaded chunk points into host memory between
    uses: its device is the host's while the forward computes on the engine's. Before the
    first plan and once the runtime is closed (retired, destroyed, dropped) the parameters are
    plain tensors again and the class's own answer is given.

    The property of the module's class is wrapped once (it consults ``_DEVICE_OF``, so other
    instances of the class are untouched): swapping each instance to a subclass would change
    the class name ``save_pretrained`` writes as the config's architecture, and pickling."""
    for m in module.modules():
        cls = type(m)
        prop = inspect.getattr_static(cls, "device", None)
        if not isinstance(prop, property) or prop.fget is None:
            continue
        if not getattr(prop.fget, "_protrain_device", False):
            cls.device = property(_engine_device_or(prop.fget), prop.fset, prop.fdel, prop.__doc__)
        _DEVICE_OF[m] = weakref.ref(engine)


def _engine_device_or(own):
    def device(self):
        ref = _DEVICE_OF.get(self)
        engine = ref() if ref is not None else None
        if engine is not None and engine.protrain_runtime is not None:
            return engine.device
        return own(self)
    device._protrain_device = True
    return device


def _buffers_to(module: torch.nn.Module, device: torch.device) -> None:
    """Every buffer of ``module`` on ``device``, as ``module.to(device)`` puts them (the same
    module attributes, new tensors); parameters are left where they are."""
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[name] = b.to(device)


def _no_kv_cache(module, kwargs: dict) -> dict:
    """Training forwards of a model that can keep a KV cache (Hugging Face ``use_cache``) run
    without it: a recomputed block would append its keys to the cache again."""
    if module.training and "use_cache" not in kwargs and model_takes(module, "use_cache"):
        return dict(kwargs, use_cache=False)
    return kwargs


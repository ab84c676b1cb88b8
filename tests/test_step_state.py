"""The chunk optimizer's step cycle (runtime/optimizer.py ``StepState``): the events that move it
and what the adapters ask of it (whether a backward can be redone, which gradients a re-plan
keeps). The engine-level behaviour behind each answer is in test_oom.py, test_batch_shapes.py
and test_checkpoint.py."""
import torch
from torch import nn

from protrain.runtime.adam import AdamHyper, TorchAdamKernel
from protrain.runtime.chunks import ChunkManager
from protrain.runtime.optimizer import ChunkOptimizer, StepState
from protrain.runtime.options import OptimizerSetup
from protrain.runtime.streams import Streams


def _optimizer(grad_accumulation_steps: int):
    dev = torch.device("cpu")
    streams = Streams(dev)
    params = [nn.Parameter(torch.zeros(64)) for _ in range(2)]
    chunks = ChunkManager(named_params=[(f"p{i}", p) for i, p in enumerate(params)], param_chunk=[0, 1],
                          chunk_parts=[(1, 1)] * 2, n_persist=1, n_buffer=1, chunk_capacity=64,
                          group_of={p: 0 for p in params}, device=dev, streams=streams,
                          grad_accumulation=grad_accumulation_steps > 1)
    kernel = TorchAdamKernel(fused=False)
    setup = OptimizerSetup(param_groups=[{"params": params, "lr": 1e-3}], adamw=True,
                           hyper=lambda g: AdamHyper(g["lr"], 0.9, 0.999, 1e-8, 0.0, True, True),
                           grad_accumulation_steps=grad_accumulation_steps, host_thread=False)
    opt = ChunkOptimizer(chunks, streams, setup, host_kernel=kernel, device_kernel=kernel,
                         params_in_order=params)
    return opt, chunks, params


def _gradient(opt, p) -> None:
    p.grad = torch.ones_like(p)
    opt.on_grad(p)                       # the post-accumulate-grad hook


def test_the_step_cycle_moves_on_its_events_and_answers_the_adapters():
    opt, chunks, params = _optimizer(grad_accumulation_steps=2)
    persistent, offloaded = chunks.chunks
    assert persistent.persistent and not offloaded.persistent
    assert opt.step_state is StepState.IDLE and opt.first_step_of_plan
    assert opt.can_redo_micro_batch() and not opt.holds_accumulated_gradients()
    opt.pre_forward()
    assert opt.step_state is StepState.IDLE          # nothing held: nothing accumulated
    _gradient(opt, params[0])
    # the first micro-batch's backward: redone alone after an OOM; a longer batch's re-plan
    # before the next forward keeps its gradients
    assert opt.step_state is StepState.BACKWARD
    assert opt.can_redo_micro_batch() and opt.holds_accumulated_gradients()
    opt.pre_forward()                                 # the second micro-batch
    assert opt.step_state is StepState.ACCUMULATED and not opt.can_redo_micro_batch()
    _gradient(opt, params[0])
    assert opt.step_state is StepState.ACCUMULATED and torch.all(persistent.grad == 2)

    offloaded.grad_acc.fill_(0.5)                     # what the offloaded chunk accumulated
    opt.discard_gradients()                           # a backward dropped, a checkpoint loaded
    assert opt.step_state is StepState.IDLE
    assert torch.all(persistent.grad == 0) and torch.all(offloaded.grad_acc == 0)
    assert not any(s.has_grad for c in chunks.chunks for s in c.slots)

    before = persistent.master.clone()
    opt.step()                                        # no gradient since: nothing moves
    assert torch.equal(persistent.master, before) and opt.first_step_of_plan

    opt.carry_gradients()                             # a re-plan within the step brought some
    assert opt.step_state is StepState.ACCUMULATED and opt.holds_accumulated_gradients()
    _gradient(opt, params[0])
    opt.step()
    assert opt.step_state is StepState.IDLE and not opt.first_step_of_plan
    assert not torch.equal(persistent.master, before) and torch.all(persistent.grad == 0)
    opt.worker.close()
    chunks.close()


def test_without_accumulation_a_replan_keeps_no_gradient():
    """A step's gradients are then one micro-batch's: a re-plan drops them and the micro-batch
    is redone, even when a forward began after them (an evaluation forward before step)."""
    opt, chunks, params = _optimizer(grad_accumulation_steps=1)
    _gradient(opt, params[0])
    opt.pre_forward()
    assert opt.step_state is StepState.ACCUMULATED
    assert not opt.holds_accumulated_gradients() and opt.can_redo_micro_batch()
    opt.worker.close()
    chunks.close()


def test_scale_gradients_rescales_what_the_step_accumulated():
    """Sequence parallelism's first micro-step after a plan: the script's loss factor differs
    from the one the sub-steps used, so every gradient accumulated so far is multiplied by the
    ratio - the persistent chunk's on the device, the offloaded chunk's where it landed on the
    host - before anything of the step is applied."""
    opt, chunks, params = _optimizer(grad_accumulation_steps=2)
    persistent, offloaded = chunks.chunks
    _gradient(opt, params[0])
    host = opt._host_grads(offloaded)
    host.fill_(3.0)                                   # the offloaded chunk's landed gradients
    assert opt.first_step_of_plan
    opt.scale_gradients(0.25)
    assert torch.all(persistent.grad == 0.25) and torch.all(host == 0.75)
    opt.worker.close()
    chunks.close()

"""One rank of a 2-rank tensor-parallel megatron-core GPT on CPU (gloo), for
tests/test_megatron.py: every rank profiles, rank 0 plans, both apply the same plan; the
gradients must equal the run without a policy on each rank."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))


def main(rank: int, world: int, port: str, out_dir: str, pins: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    from megatron_cpu import batch, gpt, loss_and_grads

    class _Patch:
        def setattr(self, obj, name, value):
            setattr(obj, name, value)
    from megatron_cpu import cpu_rng_states
    cpu_rng_states(_Patch())
    from protrain.profile.hardware import HardwareProfile
    from protrain_megatron import plan_activations
    hw = HardwareProfile(name="cpu-test", source="measured", device_type="cpu", device_memory=2**30,
                         host_memory=2**30, h2d_bandwidth=1e9, d2h_bandwidth=1e9, gpu_adam_rate=1e9,
                         cpu_adam_rate=1e8)
    model = gpt(num_layers=4, hidden=128, seq=64)
    sample = batch(seq=64)
    loss0, grads0 = loss_and_grads(model, sample)
    plan_file = os.path.join(out_dir, "plan.json" if rank == 0 else f"absent-on-rank{rank}.json")
    applied = plan_activations(model, sample, hardware=hw, pins=json.loads(pins), prefer_native=False,
                               progress=False, verbose=False, plan_file=plan_file)
    loss1, grads1 = loss_and_grads(model, sample)
    applied.close()
    # Again, with the plan file on rank 0's disk only: rank 0's file decides for every rank
    # (a rank profiling alone would wait forever on its tensor-parallel peer).
    again = plan_activations(model, sample, hardware=hw, progress=False, verbose=False, plan_file=plan_file)
    again.close()
    result = {"rank": rank, "modes": "".join(m.letter for m in applied.plan.block_modes),
              "params": sum(p.numel() for p in model.parameters()),
              "state_params": applied.states.params,
              "loss_equal": bool(torch.equal(loss0, loss1)),
              "grads_equal": all(torch.equal(grads0[k], grads1[k]) for k in grads0),
              "profiled": applied.profile is not None,
              "reloaded_modes": "".join(m.letter for m in again.plan.block_modes),
              "reprofiled": again.profile is not None}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])

"""One rank of a 2-rank megatron-core GPT on CPU (gloo), for tests/test_megatron.py.

mode "tp": tensor parallel 2 - every rank profiles, rank 0 plans, both apply the same plan.
mode "tp-oom": the same, with rank 1's profile running out of memory (both must fall back).
mode "pp": pipeline parallel 2 - each stage profiles its own layers (the later stage on a
random stage input, as the Megatron-LM wiring does) and plans for its micro-batches in flight.
Either way the gradients must equal the run without a policy on each rank."""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))


class _Patch:
    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def _pp_model():
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from protrain_megatron.sdpa_attention import SDPACoreAttention
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=4, hidden_size=128, num_attention_heads=4, use_cpu_initialization=True,
                            add_bias_linear=False, pipeline_dtype=torch.float32,
                            pipeline_model_parallel_size=2)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=64,
                    position_embedding_type="learned_absolute", pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage())


def main(rank: int, world: int, port: str, out_dir: str, pins: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))   # as a launcher sets it (not inherited from the test process)
    from datetime import timedelta
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from megatron.core import parallel_state
    if mode.startswith("tp"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    else:
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    from megatron_cpu import batch, cpu_rng_states, gpt, loss_and_grads
    cpu_rng_states(_Patch())
    from protrain.profile.hardware import HardwareProfile
    from protrain_megatron import plan_activations
    from protrain_megatron.training import synthetic_step
    hw = HardwareProfile(name="cpu-test", source="measured", device_type="cpu", device_memory=2**30,
                         host_memory=2**30, h2d_bandwidth=1e9, d2h_bandwidth=1e9, gpu_adam_rate=1e9,
                         cpu_adam_rate=1e8)
    result = {"rank": rank}
    if mode.startswith("tp"):
        model = gpt(num_layers=4, hidden=128, seq=64)
        sample = batch(seq=64)
        run = lambda: loss_and_grads(model, sample)  # noqa: E731
        kw = {}
        if mode == "tp-oom":
            # Rank 1 runs out of memory at the end of its profile (after the last collective
            # it shares with rank 0, whose profile succeeds).
            import protrain_megatron.apply as apply_mod
            real = apply_mod.profile_megatron
            fallback = real(apply_mod.unwrap(model), sample, device=torch.device("cpu"), progress=False)
            kw["fallback_profile"] = lambda: fallback

            def profile_then_oom(*a, **k):
                out = real(*a, **k)
                if rank == 1:
                    raise torch.OutOfMemoryError("CUDA out of memory (injected on rank 1)")
                return out
            apply_mod.profile_megatron = profile_then_oom
    else:
        model = _pp_model()
        args = SimpleNamespace(micro_batch_size=2, seq_length=64, padded_vocab_size=128, hidden_size=128,
                               tensor_model_parallel_size=1, sequence_parallel=False)
        sample = synthetic_step(model, args, model)

        def run():
            torch.manual_seed(5)
            model.zero_grad(set_to_none=True)
            loss = sample(model)        # the same stage input and tokens every time
            loss.backward()
            return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        kw = {"in_flight_microbatches": world - parallel_state.get_pipeline_model_parallel_rank()}
    loss0, grads0 = run()
    plan_file = os.path.join(out_dir, "plan.json" if rank == 0 else f"absent-on-rank{rank}.json")
    applied = plan_activations(model, sample, hardware=hw, pins=json.loads(pins), prefer_native=False,
                               progress=False, verbose=False, plan_file=plan_file if mode == "tp" else None,
                               **kw)
    loss1, grads1 = run()
    applied.close()
    result.update(modes="".join(m.letter for m in applied.plan.block_modes),
                  layers=applied.explain().split("layers (global numbers): ")[1].split("\n")[0],
                  notes=list(applied.plan.notes), source=applied.plan.profile_source,
                  params=sum(p.numel() for p in model.parameters()), state_params=applied.states.params,
                  loss_equal=bool(torch.equal(loss0, loss1)),
                  grads_equal=len(grads0) > 0 and all(torch.equal(grads0[k], grads1[k]) for k in grads0),
                  profiled=applied.profile is not None)
    if mode == "tp":
        # Again, with the plan file on rank 0's disk only: rank 0's file decides for every rank
        # (a rank profiling alone would wait forever on its tensor-parallel peer).
        again = plan_activations(model, sample, hardware=hw, progress=False, verbose=False,
                                 plan_file=plan_file)
        again.close()
        result.update(reloaded_modes="".join(m.letter for m in again.plan.block_modes),
                      reprofiled=again.profile is not None)
        # Rank 0's plan file does not fit this run (other model states): every rank stops,
        # rank 1 too, which would otherwise wait for rank 0's plan in the broadcast.
        from protrain_megatron import MegatronStates
        try:
            plan_activations(model, sample, hardware=hw, progress=False, verbose=False,
                             plan_file=plan_file, states=MegatronStates(params=1))
            result.update(refused=None)
        except Exception as e:  # noqa: BLE001 - what each rank raised is the result
            result.update(refused=f"{type(e).__name__}: {e}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6])

"""megatron-core GPTModel on CPU for tests (gloo, local layer spec, SDPA core attention,
learned positions), as background.md describes."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from protrain_megatron.sdpa_attention import SDPACoreAttention


def init_parallel() -> None:
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:    # a fixed port collides with other jobs' runs
            from dpworker import free_port
            os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def cpu_rng_states(monkeypatch) -> None:
    """Megatron's own recompute saves CUDA RNG states; on CPU only the CPU one exists."""
    from megatron.core.tensor_parallel import random as mr
    monkeypatch.setattr(mr, "_get_all_rng_states",
                        lambda: (torch.get_rng_state(), None, mr.get_cuda_rng_tracker().get_states()))

    def set_states(cpu, cuda, tracker):
        torch.set_rng_state(cpu)
        mr.get_cuda_rng_tracker().set_states(tracker)
    monkeypatch.setattr(mr, "_set_all_rng_states", set_states)


def gpt(num_layers=4, hidden=64, heads=4, vocab=128, seq=32, seed=0, dropout=0.1, cp=1,
        local_attention=False, kv_heads=None, attention_dropout=None):
    """``local_attention``: keep the local spec's DotProductAttention (CPU runs need it
    replaced: pass it inside ``swap_core_attention``). ``attention_dropout`` (default
    ``dropout``): 0 for the selective mode on CPU, whose fused attention kernel has no dropout
    (with it SDPA decomposes into the math path, which keeps no attention output)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    init_parallel()
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
                            use_cpu_initialization=True, add_bias_linear=False,
                            hidden_dropout=dropout,
                            attention_dropout=dropout if attention_dropout is None else attention_dropout,
                            context_parallel_size=cp,
                            num_query_groups=kv_heads)
    spec = get_gpt_layer_local_spec()
    if not local_attention:
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=vocab,
                    max_sequence_length=seq, position_embedding_type="learned_absolute")


def batch(b=2, seq=32, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, seq), generator=g)
    pos = torch.arange(seq).unsqueeze(0).expand(b, -1)
    labels = torch.randint(0, vocab, (b, seq), generator=g)
    return {"input_ids": ids, "position_ids": pos, "attention_mask": None, "labels": labels}


def loss_and_grads(model, sample, seed=5):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model(**sample).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def two_ranks(worker: str, tmp_path, *args: str) -> list[dict]:
    """Run ``tests/<worker> RANK 2 PORT OUT_DIR *args`` as two processes (gloo on a free port)
    and return what each rank wrote to OUT_DIR/rank<r>.json."""
    import json

    from dpworker import free_port
    from ranks import run_script_ranks
    path = os.path.join(os.path.dirname(__file__), worker)
    run_script_ranks(path, ["2", str(free_port()), str(tmp_path), *args], 2)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

"""The context-parallel size ``--protrain-auto-memory`` chooses for Megatron-LM, and how long
the choice takes (CPU; it plans from the analytic profile, as at argument parsing).

    python bench/megatron_cp_plan.py

A LLaMA-2-7B-shaped model (32 layers, hidden 4096, 32 heads, 8 key/value groups, SwiGLU 11008,
bf16, distributed optimizer, micro-batch 1, global batch 16) on 8 H100 80 GB (published
figures: protrain.profile.machines) at sequence lengths from 8K to 128K tokens. Writes
bench/results/megatron_cp_plan.json: per length the chosen CP, the line for every degree
(predicted step and peak, or why it does not fit) and the wall time of the choice.
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from types import SimpleNamespace

from protrain.profile.machines import machine
from protrain.search import InfeasibleError
from protrain_megatron.arguments import MegatronOptions
from protrain_megatron.context_parallel import choose_context_parallel

WORLD = 8
MACHINE = "h100-80gb"


def llama7b_args(seq: int) -> SimpleNamespace:
    """Megatron-LM's parsed arguments for the model (as before validate_args)."""
    return SimpleNamespace(
        num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
        num_query_groups=8, swiglu=True, ffn_hidden_size=11008, seq_length=seq,
        max_position_embeddings=seq, micro_batch_size=1, global_batch_size=16, vocab_size=32000,
        padded_vocab_size=None, untie_embeddings_and_output_weights=True, bf16=True, fp16=False,
        use_distributed_optimizer=True, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        context_parallel_size=1, transformer_impl="local")


def main() -> None:
    hw = machine(MACHINE).profile()
    rows = []
    for seq in (8192, 32768, 65536, 131072, 262144):
        t0 = time.perf_counter()
        try:
            choice = choose_context_parallel(llama7b_args(seq), MegatronOptions(), world=WORLD,
                                             pinned=False, hardware=hw)
            row = {"seq": seq, "cp": choice.degree, "lines": list(choice.reasons)}
        except InfeasibleError as e:
            row = {"seq": seq, "cp": None, "lines": [str(e)]}
        row["seconds"] = round(time.perf_counter() - t0, 3)
        rows.append(row)
        print(f"seq {seq:>6}: CP={row['cp']}  ({row['seconds']:.2f} s)")
        for line in row["lines"]:
            print(f"    {line}")
    out = Path(__file__).parent / "results" / "megatron_cp_plan.json"
    out.write_text(json.dumps({"command": "python bench/megatron_cp_plan.py", "machine": MACHINE,
                               "world": WORLD, "model": "llama2-7b shape (GQA 8, SwiGLU 11008)",
                               "cpu": platform.processor() or platform.machine(), "rows": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

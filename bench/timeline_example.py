"""Records the measured iteration drawn in docs/how-it-decides.md beside its prediction:

    python bench/timeline_example.py && protrain explain /tmp/readme_plan.json --plot docs/timeline-cpu.png --trace /tmp/readme_trace.json
"""
import sys; sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests"))
from dstrain import base_config, with_protrain, train
from protrain.models import GPTConfig
cfg = GPTConfig(n_layer=6, n_embd=256, n_head=4, vocab_size=1024, block_size=128, tie_embeddings=False)
_, _, e = train(with_protrain(base_config(gradient_clipping=1.0), chunk_size="1MiB", n_persist=2, n_checkpoint=2, n_swap=1,
                              trace_file="/tmp/readme_trace.json", plan_file="/tmp/readme_plan.json", accounting=True), cfg, 6)
e.destroy()

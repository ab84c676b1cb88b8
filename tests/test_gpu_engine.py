"""CUDA-only: the engine on a GPU - streams, pinned host memory, fused device Adam - against
DeepSpeed, and its measured peak against the plan's prediction."""
import json

import pytest
import torch

from dstrain import base_config, train, with_protrain

from protrain.models import GPTConfig

pytestmark = pytest.mark.gpu

MID = GPTConfig(n_layer=4, n_embd=512, n_head=8, vocab_size=2048, block_size=512, tie_embeddings=False)
PINS = dict(chunk_size="4MiB", n_persist=2, n_buffer=4, n_swap=1, n_checkpoint=1)


def test_cuda_bf16_training_matches_deepspeed():
    extra = {"bf16": {"enabled": True}, "gradient_clipping": 1.0}
    ref_losses, ref_w, ref_engine = train(base_config(**extra), MID, 10)
    ref_engine.destroy()
    losses, w, engine = train(with_protrain(base_config(**extra), device_memory=None, **PINS), MID, 10)
    assert engine.protrain_runtime.chunks.offloaded(), "the plan should offload chunks"
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 0.01 * abs(b)
    for name, t in ref_w.items():
        assert (w[name] - t).abs().max() <= 0.05, name
    engine.destroy()


def test_cuda_measured_peak_is_near_the_prediction():
    import deepspeed
    from protrain.models import GPT, synthetic_batch
    cfg = with_protrain(base_config(bf16={"enabled": True}), device_memory=None, **PINS)
    cfg["train_micro_batch_size_per_gpu"] = 8
    torch.manual_seed(0)
    model = GPT(MID)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(i):
        x, y = synthetic_batch(MID, 8, seed=i, device=engine.device)
        engine.backward(engine(x, y))
        engine.step()
    step(0)                       # profiling and planning happen here: not measured
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() - engine.protrain_runtime.chunks.device_bytes()
    for i in range(1, 4):
        step(i)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    predicted = engine.protrain_plan.prediction.peak_device_bytes
    print(json.dumps({"measured_peak": peak, "predicted_peak": predicted}))
    assert abs(predicted - peak) <= 0.10 * peak
    engine.destroy()


def test_cuda_ssd_blocks_train_like_kept_ones(tmp_path):
    """Saved tensors of two blocks through the SSD tier (kvikio when it works, else POSIX) on
    a GPU: the same losses as keeping them (flash attention's backward is not bit-exact)."""
    extra = {"bf16": {"enabled": True}}
    keep = dict(chunk_size="4MiB", n_persist=2, n_buffer=4, n_swap=0, n_checkpoint=0, n_ssd=0)
    ref, _, engine = train(with_protrain(base_config(**extra), device_memory=None, **keep), MID, 5)
    engine.destroy()
    cfg = with_protrain(base_config(**extra), device_memory=None, ssd_path=str(tmp_path),
                        ssd_min_bytes=0, **dict(keep, n_ssd=2))
    losses, _, engine = train(cfg, MID, 5)
    acts = engine.protrain_runtime.activations
    print(json.dumps({"ssd_backend": acts.storage_backend, **acts.stats}))
    assert acts.stats["ssd_written_bytes"] > 0
    assert acts.stats["ssd_read_bytes"] + acts.stats["forwarded"] > 0
    for a, b in zip(losses, ref):
        assert abs(a - b) <= 1e-3 * abs(b)
    engine.destroy()
    assert not list(tmp_path.iterdir())          # the per-run directory is gone

"""A plain DeepSpeed training loop for the engine tests (the script a user already has)."""
from __future__ import annotations

import copy
import os

import torch

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")

import deepspeed  # noqa: E402  (after the distributed environment is set)

from protrain.models import GPT, GPTConfig, synthetic_batch  # noqa: E402

TINY = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64)
UNTIED = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64, tie_embeddings=False)


def base_config(**extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "steps_per_print": 10**6}
    cfg.update(copy.deepcopy(extra))
    return cfg


def with_protrain(cfg: dict, **section) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["protrain"] = {"enabled": True, "device_memory": "1GiB", "progress": False,
                       "verbosity": 0, **section}
    return cfg


def train(ds_config: dict, model_cfg: GPTConfig = TINY, steps: int = 20, seed: int = 0,
          loss_factor: float = 1.0, optimizer=None):
    """Train ``steps`` optimizer steps; returns (losses, final weights, engine). Backward runs
    on ``loss * loss_factor`` (the gradient norm's scale, e.g. to keep it under clipping).
    ``optimizer``: a function of the parameters building the script's own optimizer."""
    torch.manual_seed(seed)
    model = GPT(model_cfg)
    client = optimizer(model.parameters()) if optimizer is not None else None
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config, optimizer=client)
    losses = []
    for i in range(steps * engine.gradient_accumulation_steps()):
        x, y = synthetic_batch(model_cfg, ds_config["train_micro_batch_size_per_gpu"], seed=i,
                               device=engine.device)
        loss = engine(x, y)
        engine.backward(loss * loss_factor if loss_factor != 1.0 else loss)
        engine.step()
        losses.append(loss.item())
    # Through state_dict, a sync point: CPU Adam of the last step may still be writing
    # offloaded parameters (their tensors are views of host memory) when step() returns.
    state = model.state_dict()
    weights = {n: state[n].detach().float().cpu().clone() for n, _ in model.named_parameters()}
    return losses, weights, engine

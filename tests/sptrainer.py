"""One rank of a Hugging Face Trainer run with a DeepSpeed JSON holding "protrain" (the
Trainer script knows nothing of ProTrain or sequence parallelism). Spawned by tests."""
from __future__ import annotations

import json
import os
import sys


def run_rank(rank: int, world: int, port: int, spec: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    sys.path.insert(0, os.path.dirname(__file__))
    result = train(rank, world, spec, out_dir)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def train(rank: int, world: int, spec: dict, out_dir: str, recorder=None) -> dict:
    """One Trainer run in this (already launched) rank; returns the logged losses and the
    gradients of every optimizer step (recorded by ``recorder``, a spworker.UpdateRecorder)."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    import torch
    import transformers
    from spworker import UpdateRecorder, llama, samples
    recorder = recorder or UpdateRecorder()
    grads = recorder.start()

    class Data(torch.utils.data.Dataset):
        """Sample i of step k is row i of the spworker global batch of step k."""
        def __len__(self):
            return spec["global_batch"] * spec["steps"]

        def __getitem__(self, i):
            step, row = divmod(i, spec["global_batch"])
            ids, labels = samples(spec, step)
            return {"input_ids": ids[row], "labels": labels[row]}

    class Record(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            grads.append([])

        def on_step_end(self, args, state, control, model=None, **kw):
            # This step's host updates (CPU Adam may run into the next forward) recorded in it.
            trainer.model_wrapped.protrain_sync()

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "gradient_clipping": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                     "betas": "auto", "eps": "auto"}},
          "zero_optimization": {"stage": 0},
          "protrain": {"enabled": True, "device_memory": "4GiB", "progress": False, "verbosity": 0,
                       **spec.get("protrain", {})}}
    path = os.path.join(out_dir, f"ds{rank}.json")
    with open(path, "w") as f:
        json.dump(ds, f)
    torch.manual_seed(0)
    model = llama(spec)
    per_device = spec["global_batch"] // world
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, "out"), max_steps=spec["steps"],
        per_device_train_batch_size=per_device, logging_steps=1, learning_rate=1e-3,
        weight_decay=0.0, max_grad_norm=1.0, report_to="none", save_strategy="no", deepspeed=path,
        use_cpu=True, disable_tqdm=True, dataloader_drop_last=True, seed=0, data_seed=0,
        lr_scheduler_type="constant", ddp_backend="gloo")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(),
                                   callbacks=[Record()])
    # The same samples in the same steps whatever the world size: no shuffling (accelerate
    # hands rank r the r-th of every world-size consecutive per-device batches).
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(Data())
    trainer.train()
    engine = trainer.model_wrapped
    result = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "grads": grads, "engine": type(engine).__name__,
              "sp": engine.protrain_plan.knobs.sequence_parallel,
              "modes": "".join(m.letter for m in engine.protrain_plan.block_modes),
              "offloaded": len(engine.protrain_runtime.chunks.offloaded())}
    engine.destroy()
    if rank == 0:
        torch.save({n: p.detach().float().clone() for n, p in model.named_parameters()},
                   os.path.join(out_dir, f"weights-{spec.get('name', 'trainer')}.pt"))
    return result


def launch(world: int, spec: dict, out_dir: str) -> list[dict]:
    from ranks import start_ranks
    from dpworker import free_port
    os.makedirs(out_dir, exist_ok=True)
    start_ranks(run_rank, (world, free_port(), spec, out_dir), world)
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]

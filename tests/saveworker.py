"""One rank of the save-path checks: a Hugging Face Trainer trains a tiny Llama with a DeepSpeed
JSON holding "protrain" (offloaded chunks, sharded over the ranks), then the weights are saved
every way a user saves them; run by tests/dpworker.py (a run whose spec has "saves")."""
from __future__ import annotations

import json
import os


def run(rank: int, world: int, spec: dict, out_dir: str):
    """Train, save each way, then destroy (gathers the trained weights: the reference, rank 0
    writes it to trained.pt); (what the test reads, the destroyed engine)."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    import torch
    import torch.distributed as dist
    import transformers

    m = spec["model"]
    cfg = transformers.LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"],
                                   intermediate_size=m["ffn"], num_hidden_layers=m["layers"],
                                   num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(0, m["vocab"], (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "gradient_clipping": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                     "betas": "auto", "eps": "auto"}},
          "zero_optimization": {"stage": 0},
          "protrain": {"enabled": True, "device_memory": "4GiB", "progress": False, "verbosity": 0,
                       **spec["protrain"]}}
    path = os.path.join(out_dir, f"ds{rank}.json")
    with open(path, "w") as f:
        json.dump(ds, f)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, "run"), max_steps=spec["steps"], per_device_train_batch_size=2,
        learning_rate=1e-2, weight_decay=0.01, report_to="none", save_strategy="no", deepspeed=path,
        use_cpu=True, disable_tqdm=True, seed=0, lr_scheduler_type="constant", ddp_backend="gloo")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data())
    trainer.train()
    engine = trainer.model_wrapped
    result = {"offloaded": len(engine.protrain_runtime.chunks.offloaded()),
              "empty_between_steps": sum(p.numel() == 0 for p in model.parameters())}

    def out(name):
        return os.path.join(out_dir, name)
    # Every rank calls each of these, as with ZeRO-3; rank 0 writes.
    module_sd = engine.module.state_dict()
    accelerate_sd = trainer.accelerator.get_state_dict(engine)
    engine.save_16bit_model(out("16bit"), "model.bin")
    trainer.accelerator.unwrap_model(engine).save_pretrained(out("pretrained"), is_main_process=rank == 0)
    trainer.save_model(out("trainer"))
    if rank == 0:
        import safetensors.torch
        torch.save(module_sd, out("module_state_dict.pt"))
        safetensors.torch.save_file(accelerate_sd, out("accelerate.safetensors"))
        try:                              # what some scripts do: save on the main process only
            model.save_pretrained(out("rank0_only"))
            result["refused"] = None
        except RuntimeError as e:
            result["refused"] = str(e)
    dist.barrier()
    engine.destroy()
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out("trained.pt"))
    return result, engine

"""Issue 25's matrix as a new user meets it: tiny Hugging Face models trained by the Trainer
with a DeepSpeed JSON (all "auto"), once with ``"protrain": {"enabled": true}`` and once
without it (plain DeepSpeed ZeRO-0), everything else equal. Used in-process by
tests/test_hf_matrix.py and, one process per rank, by its two-rank launch.

A run is described by a ``case`` dict (keys below, in ``train``); it returns what the Trainer
logged (training loss per step, evaluation losses), the final weights and what ProTrain
planned, so a test compares two runs bit for bit.
"""
from __future__ import annotations

import json
import os
import sys

import torch

HIDDEN, FFN, LAYERS, HEADS, VOCAB = 32, 64, 2, 4, 128

# Tiny configs of the seven architectures, as from_config builds them (SDPA attention, every
# other setting the family's default: GPT-2 keeps its 0.1 dropouts, Gemma and GPT-2 tie the
# output head to the embedding).
ARCHS = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=8, head_dim=8)),
    "gpt2": ("GPT2Config", dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64)),
    "gemma": ("GemmaConfig", dict(num_key_value_heads=1, head_dim=8)),
    # 16 experts, one per token: with 2 x 16 tokens per micro-batch some get none in a step
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=16,
                                      num_experts_per_tok=1)),
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.5)),
}


def model_config(arch: str):
    import transformers
    name, over = ARCHS[arch]
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, max_position_embeddings=64, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
    if arch == "gpt2":
        kw = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(over)
    return getattr(transformers, name)(**kw, attn_implementation="sdpa")


def tiny_model(arch: str, seed: int = 0):
    import transformers
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(model_config(arch), attn_implementation="sdpa")


def tokenizer():
    """A word-level tokenizer made here (no download): ids 0-2 special, then VOCAB - 3 words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<pad>")


class Samples(torch.utils.data.Dataset):
    """Sample i: fixed random tokens (the same in every run). ``lengths``: one length for all,
    or a function of i (pad-to-longest batches then differ in length)."""

    def __init__(self, n: int, lengths, seed: int = 0, labels: bool = True):
        self.n, self.lengths, self.seed, self.labels = n, lengths, seed, labels

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = self.lengths(i) if callable(self.lengths) else self.lengths
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        ids = torch.randint(3, VOCAB, (s,), generator=g)
        # without labels, the language-modelling collator makes them (-100 at padding)
        return {"input_ids": ids, "labels": ids.clone()} if self.labels else {"input_ids": ids}


def ds_json(case: dict) -> dict:
    """The DeepSpeed config a Trainer user writes: every batch and optimizer value "auto"."""
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto",
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                      "betas": "auto", "eps": "auto"}},
           "zero_optimization": {"stage": 3 if case.get("zero3") else 0}}
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": "auto"}
    if case.get("scheduler"):
        cfg["scheduler"] = {"type": "WarmupLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}
    if case.get("protrain"):
        cfg["protrain"] = {"enabled": True, "device_memory": "1GiB", "progress": False,
                           "verbosity": 0, **case.get("protrain_section", {})}
    return cfg


def offloading(model) -> dict:
    """Pins that put most of ``model`` through the offload path: chunks of its largest
    trainable parameter, one of them kept on the device, one block recomputed."""
    largest = max((p for p in model.parameters() if p.requires_grad), key=lambda p: p.numel())
    return {"chunk_size": largest.numel() * largest.element_size(), "n_persist": 1, "n_checkpoint": 1}


def train(case: dict, out_dir: str) -> dict:
    """One Trainer run. Keys of ``case``: arch, protrain (bool), steps, batch (per device),
    seq, gas, bf16, scheduler, grad_ckpt (the Trainer's gradient_checkpointing), lora (PEFT),
    eval (an evaluation set, evaluated every ``eval_steps``), lengths ("fixed", "longest":
    pad-to-longest with the first batch the longest, "growing": a later batch longer than the
    first), save_steps, resume (a checkpoint directory), built_after_args (the model built after
    the TrainingArguments, as run_clm does), name."""
    import transformers
    name = case.get("name", case["arch"])
    out = os.path.join(out_dir, name)
    os.makedirs(out, exist_ok=True)
    model = tiny_model(case["arch"])
    if case.get("lora"):
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
            task_type="CAUSAL_LM"))
    if case.get("protrain") and case.get("offload", True):
        case = dict(case, protrain_section={**offloading(model), **case.get("protrain_section", {})})
    # one file per rank: ranks writing one file race (a rank read it while another truncated it)
    path = os.path.join(out, f"ds-rank{os.environ.get('RANK', '0')}.json")
    with open(path, "w") as f:
        json.dump(ds_json(case), f)
    seq, steps, batch = case.get("seq", 16), case.get("steps", 6), case.get("batch", 2)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = steps * batch * case.get("gas", 1) * world
    half = seq // 2
    lengths = {"fixed": seq,
               # by micro-batch (samples are taken in order): the first one the longest ...
               "longest": lambda i: seq if i < batch else seq - 1 - (i * 3) % half,
               # ... or the first one the shortest, later ones up to seq
               "growing": lambda i: half if i < batch else half + 1 + (i * 5) % half,
               }[case.get("lengths", "fixed")]
    padded = case.get("lengths", "fixed") != "fixed"
    seen = []

    def collate(features, pad=transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False)):
        out = pad(features)                 # pads to the longest sample of the micro-batch
        seen.append(int(out["input_ids"].shape[1]))
        return out
    evaluating = case.get("eval", False)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch, gradient_accumulation_steps=case.get("gas", 1),
        logging_steps=1, learning_rate=3e-3, warmup_steps=2 if case.get("scheduler") else 0,
        report_to="none", deepspeed=path, use_cpu=True, disable_tqdm=True, seed=0, data_seed=0,
        bf16=case.get("bf16", False), gradient_checkpointing=case.get("grad_ckpt", False),
        eval_strategy="steps" if evaluating else "no", eval_steps=case.get("eval_steps", 3),
        save_strategy="steps" if case.get("save_steps") else "no",
        save_steps=case.get("save_steps") or 500, ddp_backend="gloo" if world > 1 else None,
        dataloader_drop_last=True)
    if case.get("built_after_args"):
        # run_clm's order: the arguments (which read the JSON: with ZeRO-3 transformers turns
        # zero.Init on) before the model; the one above only sized the JSON's pins.
        model = tiny_model(case["arch"])
        result_partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Samples(n, lengths, labels=not padded),
        eval_dataset=Samples(4 * batch * world, seq, seed=1) if evaluating else None,
        data_collator=collate if padded else None)
    if padded:    # in order, so the lengths above are the micro-batches' (a rank takes every world-th)
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
    idle = _idle_experts(model) if case["arch"] == "mixtral" else None
    generated = []
    if case.get("generate"):
        trainer.add_callback(_SamplesDuringTraining(trainer, generated))
    trainer.train(resume_from_checkpoint=case.get("resume"))
    engine = trainer.model_wrapped
    plan = getattr(engine, "protrain_plan", None)
    result = {
        "engine": type(engine).__name__,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "steps": [h["step"] for h in trainer.state.log_history if "loss" in h],
        "eval": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
        "modes": "".join(m.letter for m in plan.block_modes) if plan else None,
        "head_tile": plan.knobs.head_tile if plan else None,
        "mlp_tile": plan.knobs.mlp_tile if plan else None,
        "tiled_forwards": engine.protrain_runtime.head_tiling.forwards
        if plan and engine.protrain_runtime.head_tiling else 0,
        "offloaded": len(engine.protrain_runtime.chunks.offloaded()) if plan else None,
        "moved_to_host": engine.protrain_runtime.activations.stats["swapped_bytes"] if plan else None,
        "trainable": len(plan.params) if plan else None,
        "idle_experts": idle() if idle else None,
        "lengths": seen, "generated": generated,
        "gradient_checkpointing": bool(getattr(_base(model), "is_gradient_checkpointing", False)),
        "built_partitioned": result_partitioned if case.get("built_after_args") else None,
    }
    if case.get("save_steps"):         # what the Trainer saved at the last checkpoint
        from safetensors.torch import load_file
        last = max((d for d in os.listdir(out) if d.startswith("checkpoint-")),
                   key=lambda d: int(d.split("-")[1]))
        result["saved"] = load_file(os.path.join(out, last, "model.safetensors"))
    if case.get("zero3"):               # the user's usual way to get the weights out
        from safetensors.torch import load_file
        final = os.path.join(out, "final")
        trainer.save_model(final)
        result["final_saved"] = load_file(os.path.join(final, "model.safetensors")) \
            if os.path.exists(os.path.join(final, "model.safetensors")) else None
    engine.destroy()                   # gathers parameters sharded over ranks back
    result["weights"] = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    # One training per process, as users run them: with a ZeRO-3 JSON the Trainer leaves
    # transformers' ZeRO-3 switch on, and the next run's model would be built under zero.Init.
    from transformers.integrations import deepspeed as hf_deepspeed
    hf_deepspeed.unset_hf_deepspeed_config()
    return result


class _SamplesDuringTraining:
    """TRL's way to sample during training (GRPO, RLOO, its generation callbacks): after the
    second step, ``unwrap_model_for_generation`` (with a ZeRO-3 JSON it gathers the parameters
    and removes ZeRO-3's hooks) around a greedy ``generate``; training then goes on."""

    def __init__(self, trainer, out: list):
        self.trainer, self.out = trainer, out

    def __getattr__(self, name):          # every other TrainerCallback event: nothing
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 2:
            return
        from trl.models.utils import unwrap_model_for_generation
        engine = self.trainer.model_wrapped
        with unwrap_model_for_generation(engine, self.trainer.accelerator) as unwrapped:
            self.out.append(unwrapped.generate(torch.arange(1, 6).unsqueeze(0), max_new_tokens=6,
                                               do_sample=False, pad_token_id=0).tolist())


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _idle_experts(model):
    """Counts, per forward of each MoE layer, how many experts received no token; returns a
    function giving the most seen in one forward."""
    most = [0]

    def count(module, args, _out):
        top_k_index = args[1]
        used = torch.unique(top_k_index).numel()
        most[0] = max(most[0], module.num_experts - used)
    for m in model.modules():
        if type(m).__name__ == "MixtralExperts":
            m.register_forward_hook(count)
    return lambda: most[0]


# ---- two ranks: one launch runs several cases, each with and without ProTrain --------------
HANG_S = 420
"""A launch still running after this many seconds is stuck: each rank prints its stack and exits."""

def run_rank(rank: int, world: int, port: int, cases: list[dict], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      ACCELERATE_USE_DEEPSPEED="true")
    sys.path.insert(0, os.path.dirname(__file__))
    import faulthandler
    faulthandler.dump_traceback_later(HANG_S, exit=True)   # a rank stuck in a collective: say where
    results = {}
    for case in cases:
        if case.get("refuse"):
            results[case["name"]] = _refusal(case)
            continue
        # An error stops the launch (the other rank would wait for this one in a collective):
        # start_processes raises it in the test, naming the rank, with its traceback.
        r = train(case, out_dir)
        tensors = {k: r.pop(k) for k in ("weights", "saved") if k in r}
        if rank == 0:
            torch.save(tensors, os.path.join(out_dir, f"weights-{case['name']}.pt"))
        results[case["name"]] = r
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _refusal(case: dict) -> dict:
    """deepspeed.initialize with a bad protrain section on every rank: what each rank raised."""
    import deepspeed
    from protrain.config import ConfigError
    if case["arch"] == "no-position-ids":
        model = _NoPositionIds()
    else:
        model = tiny_model(case["arch"])
    cfg = ds_json({"protrain": True, "protrain_section": case["protrain_section"]})
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
               train_batch_size=2 * int(os.environ["WORLD_SIZE"]), gradient_clipping=1.0)
    cfg["optimizer"]["params"] = {"lr": 1e-3}
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except ConfigError as e:
        return {"refused": str(e)}
    return {"refused": None}


class _NoPositionIds(torch.nn.Module):
    """A model whose forward takes no position_ids: sequence shards could not be placed."""

    def __init__(self):
        super().__init__()
        from protrain.models import GPT, GPTConfig
        self.gpt = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, block_size=64))

    def forward(self, idx, targets=None):
        return self.gpt(idx, targets)


def launch(world: int, cases: list[dict], out_dir: str) -> list[dict]:
    from ranks import start_ranks
    from dpworker import free_port
    os.makedirs(out_dir, exist_ok=True)
    start_ranks(run_rank, (world, free_port(), cases, out_dir), world)
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]

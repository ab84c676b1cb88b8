"""Batches that change shape after the plan is made (pad-to-longest collators, curricula): the
engine plans for a longer batch before its forward, moves every state into the new plan and
trains exactly as plain DeepSpeed does, with the runtime's device bytes within the plan in
force at every step; ``max_seq_len`` plans once; plan files made for shorter batches are
planned again. Several ranks: tests/test_data_parallel.py (the "shapes" runs); the Hugging
Face Trainer with a pad-to-longest collator: test_hugging_face_trainer_pads_to_the_longest."""
import functools
import json
import os

import pytest
import torch

from dstrain import UNTIED, base_config, with_protrain

import deepspeed
import protrain_ds.engine as engine_mod
from protrain.batch_shape import BatchShape, model_max_seq_len, replan_shape
from protrain.models import GPT, synthetic_batch
from protrain.plan import Plan

# (micro-batch, tokens) of each micro-batch: profiled at 2 x 16, then longer, and a smaller
# last batch.
BATCHES = ((2, 16), (2, 16), (2, 40), (2, 64), (2, 40), (1, 12))
# Offloaded chunks, a swapped block (its host arena sized from the profile) and checkpoints.
PINS = dict(chunk_size="110KiB", n_persist=2, n_buffer=4, n_swap=1, n_checkpoint=2)


def shaped_run(ds_config: dict, batches=BATCHES, *, inject=None):
    """Train on ``batches`` (one per micro-batch); returns losses, weights, the engine, and per
    micro-batch (runtime's device peak, the plan in force's bound, its covered shape)."""
    torch.manual_seed(0)
    model = GPT(UNTIED)
    injector = inject(model) if inject else None
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    if injector is not None:
        injector.engine = engine
    losses, peaks = [], []
    for i, (mb, seq) in enumerate(batches):
        x, y = synthetic_batch(UNTIED, 2, seq, seed=i)
        loss = engine(x[:mb], y[:mb])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        rt = getattr(engine, "protrain_runtime", None)
        if rt is not None and rt.accounting is not None:
            plan = engine.protrain_plan
            peaks.append((rt.device_peak(), plan.prediction.peak_device_bytes * (1 + plan.memory_margin),
                          (plan.micro_batch, plan.seq_len)))
    state = model.state_dict()
    weights = {n: state[n].detach().float().cpu().clone() for n, _ in model.named_parameters()}
    return losses, weights, engine, peaks


@functools.lru_cache(maxsize=None)
def deepspeed_reference(batches=BATCHES, extra: str = "{}"):
    losses, weights, engine, _ = shaped_run(base_config(**json.loads(extra)), batches)
    return losses, weights


@pytest.fixture
def runtimes_built(monkeypatch):
    built = []
    real = engine_mod.ProTrainRuntime

    def build(*args, **kwargs):
        built.append(args[2])            # the plan
        return real(*args, **kwargs)
    monkeypatch.setattr(engine_mod, "ProTrainRuntime", build)
    return built


def _same(weights, ref):
    return all(torch.equal(weights[n], w) for n, w in ref.items())


def test_the_replan_shape_rounds_up_to_a_power_of_two_capped_by_the_model():
    need = BatchShape(2, 40)
    assert replan_shape(need, micro_batch=2, model_max=None) == BatchShape(2, 64)
    assert replan_shape(need, micro_batch=4, model_max=48) == BatchShape(4, 48)
    assert replan_shape(BatchShape(3, 100), micro_batch=2, model_max=64) == BatchShape(3, 100)
    assert replan_shape(BatchShape(2, 64), micro_batch=2, model_max=None) == BatchShape(2, 64)
    assert BatchShape(2, 64).covers(BatchShape(1, 12)) and not BatchShape(2, 64).covers(BatchShape(4, 8))
    assert model_max_seq_len(GPT(UNTIED)) == UNTIED.block_size


def test_longer_batches_are_planned_for_and_train_exactly_like_deepspeed(runtimes_built, capsys):
    """2 x 16, then 40 and 64 tokens, and a smaller last batch: one re-plan (for 64: 40
    rounded up), losses and weights bit for bit DeepSpeed ZeRO-0's, and the runtime's own
    count of device bytes within the predicted peak x (1 + margin) of the plan in force at
    every step (it reached 1.98x the 16-token plan's without the re-plan)."""
    ref_losses, ref_weights = deepspeed_reference()
    losses, weights, engine, peaks = shaped_run(with_protrain(base_config(), accounting=True, **PINS))
    out = capsys.readouterr().out
    assert losses == ref_losses and _same(weights, ref_weights)
    assert [(p.micro_batch, p.seq_len) for p in runtimes_built] == [(2, 16), (2, 64)]
    assert out.count("re-planned") == 1
    assert "ProTrain: batch 2 x 40 is beyond the plan's 2 x 16; re-planned for 2 x 64: " \
           "(112640, 2, 4, 1, 2, 0, 0) -> (112640, 2, 4, 1, 2, 0, 0), predicted peak" in out
    assert [p[2] for p in peaks] == [(2, 16)] * 2 + [(2, 64)] * 4
    for step, (peak, bound, _) in enumerate(peaks):
        assert 0 < peak <= bound, (step, peak, bound)
    acts = engine.protrain_runtime.activations
    assert acts.stats["swapped_bytes"] > 0 and not any(s.extra for s in acts.stashes.values())
    engine.destroy()


def test_a_longer_batch_inside_an_accumulation_window_keeps_its_gradients(runtimes_built):
    """The 40-token micro-batch is the second of its optimizer step's two: the gradients of
    the first move into the new plan's chunks with the rest of the states."""
    batches = ((2, 16), (2, 40), (2, 16), (2, 64), (2, 40), (1, 12))
    extra = json.dumps({"gradient_accumulation_steps": 2})
    ref_losses, ref_weights = deepspeed_reference(batches, extra)
    losses, weights, engine, _ = shaped_run(
        with_protrain(base_config(gradient_accumulation_steps=2), **PINS), batches)
    assert len(runtimes_built) == 2 and engine.global_steps == 3
    assert losses == ref_losses and _same(weights, ref_weights)
    engine.destroy()


def test_max_seq_len_plans_once_for_the_longest(runtimes_built, capsys):
    ref_losses, ref_weights = deepspeed_reference()
    losses, weights, engine, peaks = shaped_run(with_protrain(base_config(), accounting=True,
                                                              max_seq_len=64, **PINS))
    out = capsys.readouterr().out
    assert [(p.micro_batch, p.seq_len) for p in runtimes_built] == [(2, 64)]
    assert "re-planned" not in out
    assert losses == ref_losses and _same(weights, ref_weights)
    assert all(0 < peak <= bound for peak, bound, _ in peaks)
    engine.destroy()
    # "auto": the model's own maximum (the GPT's block_size here)
    _, _, engine, _ = shaped_run(with_protrain(base_config(), max_seq_len="auto", **PINS), BATCHES[:1])
    assert engine.protrain_plan.seq_len == UNTIED.block_size
    engine.destroy()


def test_an_out_of_memory_error_after_a_longer_batch_plans_for_the_longer_batch(runtimes_built):
    """The OOM re-plan plans for the shape in force (the 16-token profile scaled to 64), not
    for the shape the profile was taken at."""
    from test_oom import InjectOOM
    ref_losses, _ = deepspeed_reference()
    losses, _, engine, _ = shaped_run(with_protrain(base_config(), **PINS),
                                      inject=lambda m: InjectOOM(m, "forward", {5}))
    assert [(p.seq_len, p.memory_margin) for p in runtimes_built] == [(16, 0.1), (64, 0.1), (64, 0.2)]
    assert losses == ref_losses
    engine.destroy()


def test_a_plan_file_made_for_shorter_batches_is_planned_again_and_saved(tmp_path, capsys):
    """Loaded for 2 x 16, it runs the 16-token batches and plans again at a 40-token one (the
    profile taken then: a loaded plan has none); saved for 2 x 64, the next run loads it and
    runs every shorter batch under it. A plan file for 2 x 16 meeting a 40-token first batch is
    planned again at once, not refused."""
    path = tmp_path / "plan.json"
    cfg = with_protrain(base_config(), plan_file=str(path), verbosity=1, **PINS)
    shaped_run(cfg, BATCHES[:1])[2].destroy()
    assert Plan.load(path).seq_len == 16
    (tmp_path / "copy.json").write_text(path.read_text())
    capsys.readouterr()
    _, _, engine, _ = shaped_run(cfg, ((2, 16), (2, 40)))
    out = capsys.readouterr().out
    assert "plan loaded from" in out and "re-planned for 2 x 64" in out and f"saved to {path}" in out
    assert Plan.load(path).seq_len == 64 and engine.protrain_profile.seq_len == 40
    engine.destroy()
    _, _, engine, _ = shaped_run(cfg, ((1, 12), (2, 64)))
    out = capsys.readouterr().out
    assert "plan loaded from" in out and "re-planned" not in out and engine.protrain_profile is None
    engine.destroy()
    first_longer = with_protrain(base_config(), plan_file=str(tmp_path / "copy.json"), verbosity=1, **PINS)
    _, _, engine, _ = shaped_run(first_longer, ((2, 40),))
    out = capsys.readouterr().out
    assert "was made for batches up to 2 x 16, this run's need 2 x 40: planning again" in out
    assert Plan.load(tmp_path / "copy.json").seq_len == 40
    engine.destroy()


def _trainer_run(tmp_path, protrain: dict | None):
    """A Hugging Face Trainer script as a user writes it: a tiny Llama, a tokenizer, and
    DataCollatorForLanguageModeling, which pads each batch to its longest sample (labels -100
    on the padding). Returns the logged losses, the trained weights and the engine."""
    import tokenizers
    import transformers
    from accelerate.state import AcceleratorState, PartialState
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, 128)}}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]",
                                                     unk_token="[UNK]")
    g = torch.Generator().manual_seed(0)
    # batches of 2 padded to 16, 40, 64 tokens, and a last batch of one sample
    texts = [" ".join(f"t{int(t)}" for t in torch.randint(2, 128, (n,), generator=g))
             for n in (16, 9, 40, 23, 64, 50, 12)]
    data = [tokenizer(t) for t in texts]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation="sdpa"))
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "gradient_clipping": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                     "betas": "auto", "eps": "auto"}},
          "zero_optimization": {"stage": 0}}
    if protrain is not None:
        ds["protrain"] = {"enabled": True, "device_memory": "4GiB", "progress": False,
                          "verbosity": 0, **protrain}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), num_train_epochs=1, per_device_train_batch_size=2,
        logging_steps=1, learning_rate=1e-3, report_to="none", save_strategy="no", deepspeed=ds,
        use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, lr_scheduler_type="constant")
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data,
        data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(data)
    try:
        trainer.train()
        engine = trainer.model_wrapped
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        result = (losses, engine.protrain_plan if protrain is not None else None,
                  len(engine.protrain_runtime.chunks.offloaded()) if protrain is not None else None)
        engine.destroy()
        weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    finally:
        AcceleratorState._reset_state(True)
        PartialState._reset_state()
    return result[0], weights, result[1], result[2]


def test_hugging_face_trainer_pads_to_the_longest(tmp_path, monkeypatch, capsys):
    """The Trainer with a pad-to-longest collator, an offloading plan (one chunk on the device)
    and nothing else changed: bit for bit what DeepSpeed ZeRO-0 trains, re-planning for the
    longer batches as they come."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    # accelerate sets it (and torch's thread count) when unset: keep this process's as it is
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())))
    ref_losses, ref_weights, _, _ = _trainer_run(tmp_path / "ref", None)
    capsys.readouterr()
    losses, weights, plan, offloaded = _trainer_run(tmp_path / "protrain",
                                                    dict(chunk_size="40KiB", n_persist=1))
    out = capsys.readouterr().out
    assert len(losses) == 4 and losses == ref_losses
    assert _same(weights, ref_weights)
    assert offloaded > 0 and (plan.micro_batch, plan.seq_len) == (2, 64)
    assert "batch 2 x 40 is beyond the plan's 2 x 16; re-planned for 2 x 64" in out
    assert out.count("re-planned") == 1

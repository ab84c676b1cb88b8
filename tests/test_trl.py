"""Issue 33: TRL's DPOTrainer with a reference model, as a TRL user runs it - the same script
once with ``"protrain": {"enabled": true}`` in the DeepSpeed JSON and once without it.

The reference model goes through ``deepspeed.initialize`` without an optimizer (TRL's
``prepare_deepspeed``): ProTrain steps aside and plain DeepSpeed runs it. The policy model is
trained by ProTrain with most chunks offloaded and a block recomputed, and TRL computes its
log-probabilities with a fused LM head that reads ``lm_head.weight`` itself, outside the
module's call. In fp32 every logged loss and reward and every final weight equal plain
DeepSpeed ZeRO-0's, bit for bit; in bf16 (TRL's default) within bf16's error."""
import json
import os

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

import dstrain  # noqa: E402,F401  (the single-rank distributed environment)
import hfmatrix  # noqa: E402

STEPS = 4


def preferences(n: int):
    """Prompt / chosen / rejected strings over the tokenizer's words, fixed per index."""
    import datasets
    g = torch.Generator().manual_seed(7)

    def words(k: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, hfmatrix.VOCAB - 3, (k,), generator=g))
    rows = [dict(prompt=words(5), chosen=words(4), rejected=words(3 + i % 3)) for i in range(n)]
    return datasets.Dataset.from_list(rows)


def dpo_run(protrain: bool, out, bf16: bool = False) -> dict:
    import trl
    model = hfmatrix.tiny_model("llama")
    ref = hfmatrix.tiny_model("llama")
    case = dict(protrain=protrain)
    if protrain:
        case["protrain_section"] = hfmatrix.offloading(model)
    path = os.path.join(str(out), f"ds-{protrain}.json")
    with open(path, "w") as f:
        json.dump(hfmatrix.ds_json(case), f)
    args = trl.DPOConfig(
        output_dir=os.path.join(str(out), str(protrain)), max_steps=STEPS,
        per_device_train_batch_size=2, learning_rate=3e-3, logging_steps=1, report_to="none",
        deepspeed=path, use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, max_length=32,
        save_strategy="no", dataloader_drop_last=True, bf16=bf16)
    trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args,
                             train_dataset=preferences(2 * STEPS),
                             processing_class=hfmatrix.tokenizer())
    trainer.train()
    engine, ref_engine = trainer.model_wrapped, trainer.ref_model
    logged = [h for h in trainer.state.log_history if "loss" in h]
    result = {
        "engine": type(engine).__name__,
        "ref_engine": type(ref_engine).__name__,
        "offloaded": len(engine.protrain_runtime.chunks.offloaded()) if protrain else 0,
        "modes": "".join(m.letter for m in engine.protrain_plan.block_modes) if protrain else "",
        "logged": [(h["loss"], h.get("rewards/chosen"), h.get("rewards/rejected")) for h in logged],
        "norms": [h.get("grad_norm") for h in logged], "lrs": [h.get("learning_rate") for h in logged],
    }
    engine.destroy()
    result["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    result["ref_weights"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return result


@pytest.mark.matrix
def test_dpo_with_a_reference_model_trains_like_deepspeed(tmp_path):
    """fp32 (``bf16=False``: TRL's configs default to bf16): bit for bit."""
    pt = dpo_run(True, tmp_path)
    ds = dpo_run(False, tmp_path)
    assert pt["engine"] == "ProTrainEngine" and ds["engine"] == "DeepSpeedEngine"
    # the reference model: plain DeepSpeed (no optimizer: ProTrain stepped aside)
    assert pt["ref_engine"] == ds["ref_engine"] == "DeepSpeedEngine"
    assert pt["offloaded"] > 0 and "C" in pt["modes"], (pt["offloaded"], pt["modes"])
    assert len(pt["logged"]) == STEPS and pt["logged"] == ds["logged"], (pt["logged"], ds["logged"])
    changed = [n for n, w in ds["weights"].items() if not torch.equal(w, pt["weights"][n])]
    assert not changed, changed
    # the reference model is never trained
    assert all(torch.equal(w, pt["ref_weights"][n]) for n, w in ds["ref_weights"].items())
    assert any(not torch.equal(w, ds["ref_weights"][n]) for n, w in ds["weights"].items())


@pytest.mark.matrix
def test_dpo_in_bf16_trains_like_deepspeed_within_bf16_error(tmp_path):
    """TRL's default precision: accelerate adds ``"bf16": {"enabled": true}`` to the JSON, so both
    engines train in bf16 (plain DeepSpeed through its 16-bit wrapper); within bf16's error, as
    the Trainer's bf16 runs (tests/test_hf_matrix.py)."""
    pt = dpo_run(True, tmp_path, bf16=True)
    ds = dpo_run(False, tmp_path, bf16=True)
    assert pt["engine"] == "ProTrainEngine" and pt["offloaded"] > 0
    assert len(pt["logged"]) == len(ds["logged"]) == STEPS
    for a, b in zip(pt["logged"], ds["logged"]):
        assert abs(a[0] - b[0]) <= 0.01 * abs(b[0]), (pt["logged"], ds["logged"])
    for n, w in ds["weights"].items():
        assert (pt["weights"][n].float() - w.float()).abs().max() <= 0.03, n


@pytest.mark.matrix
@pytest.mark.parametrize("zero3", [False, True], ids=["zero0-json", "zero3-json"])
def test_samples_through_unwrap_model_for_generation_like_deepspeed(tmp_path, zero3):
    """TRL's ``unwrap_model_for_generation`` between training steps (GRPO, RLOO and TRL's
    generation callbacks sample so): with a ZeRO-3 JSON it gathers the parameters and takes
    ZeRO-3's hooks off the engine's optimizer, then puts them back. The samples and the training
    after them are plain DeepSpeed's (fp32)."""
    case = dict(arch="llama", zero3=zero3, generate=True, steps=4)
    pt = hfmatrix.train(dict(case, protrain=True, name="protrain"), str(tmp_path))
    ds = hfmatrix.train(dict(case, protrain=False, name="deepspeed"), str(tmp_path))
    assert pt["engine"] == "ProTrainEngine" and pt["offloaded"] > 0
    assert pt["losses"] == ds["losses"], (pt["losses"], ds["losses"])
    assert len(pt["generated"]) == 1 and pt["generated"] == ds["generated"]

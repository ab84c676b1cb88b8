"""Issue 25's matrix: what a new user tries through the Hugging Face Trainer, each run once with
``"protrain": {"enabled": true}`` in the DeepSpeed JSON and once without it (plain DeepSpeed
ZeRO-0), everything else equal. In fp32 the logged losses, the evaluation losses and the final
weights are equal bit for bit (bf16: within bf16's error). The ProTrain runs are pinned to
offload most chunks and recompute a block, so the offload path runs, not just a plan that keeps
everything on the device.

A cheap part runs in CI; the rest is marked ``matrix`` and deselected by default (pytest.ini):
    python3 -m pytest -m matrix tests/test_hf_matrix.py          # the rest
    python3 -m pytest -m "matrix or not matrix" tests/test_hf_matrix.py   # all of it
"""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import dstrain  # noqa: E402,F401  (the single-rank distributed environment)
import hfmatrix  # noqa: E402

matrix = pytest.mark.matrix


def pair(case: dict, out) -> tuple[dict, dict]:
    """The same Trainer run with ProTrain and with plain DeepSpeed."""
    pt = hfmatrix.train(dict(case, protrain=True, name="protrain"), str(out))
    ds = hfmatrix.train(dict(case, protrain=False, name="deepspeed"), str(out))
    return pt, ds


def assert_same_training(pt: dict, ds: dict, steps: int = 6) -> None:
    assert pt["engine"] == "ProTrainEngine" and ds["engine"] == "DeepSpeedEngine"
    assert pt["offloaded"] > 0 and "C" in pt["modes"], (pt["offloaded"], pt["modes"])
    assert len(pt["losses"]) == steps and pt["losses"] == ds["losses"], (pt["losses"], ds["losses"])
    assert pt["eval"] == ds["eval"]
    w1, w2 = ds["weights"], pt["weights"]
    assert set(w1) == set(w2)
    assert all(torch.equal(w2[n], w) for n, w in w1.items()), \
        [n for n, w in w1.items() if not torch.equal(w2[n], w)]


def check_case(name: str, pt: dict, ds: dict) -> None:
    """What each case adds to the equality."""
    case = CASES[name]
    if case.get("lora"):
        planned = [n for n, w in pt["weights"].items() if "lora_" in n]
        assert pt["trainable"] == len(planned) > 0        # only the adapters live in chunks
    if case.get("grad_ckpt"):
        # the plan decides per block: the model's own checkpointing is turned off
        assert ds["gradient_checkpointing"] and not pt["gradient_checkpointing"]
    if case["arch"] == "mixtral":
        assert pt["idle_experts"] > 0 and ds["idle_experts"] == pt["idle_experts"]
    lengths = pt["lengths"]
    if case.get("lengths") == "longest":
        assert lengths[0] == max(lengths) > min(lengths), lengths
    if case.get("lengths") == "growing":
        assert max(lengths[1:]) > lengths[0], lengths
    if case.get("eval"):
        assert len(pt["eval"]) == 2


CASES = {
    # in CI: three architectures and every feature at least once
    "llama, PEFT LoRA": dict(arch="llama", lora=True),
    "gpt2 (tied, dropout), the Trainer's gradient checkpointing": dict(arch="gpt2", grad_ckpt=True),
    "mixtral (idle experts), evaluation, accumulation with WarmupLR, pad-to-longest":
        dict(arch="mixtral", eval=True, gas=2, scheduler=True, lengths="longest"),
    # the matrix: each architecture alone, each feature alone
    **{arch: dict(arch=arch, matrix=True) for arch in hfmatrix.ARCHS},
    "llama, the Trainer's gradient checkpointing": dict(arch="llama", grad_ckpt=True, matrix=True),
    "llama, evaluation": dict(arch="llama", eval=True, matrix=True),
    "llama, accumulation with WarmupLR": dict(arch="llama", gas=2, scheduler=True, matrix=True),
    "llama, pad-to-longest": dict(arch="llama", lengths="longest", matrix=True),
    "llama, pad-to-longest, later batches longer": dict(arch="llama", lengths="growing", matrix=True),
    "qwen2, PEFT LoRA": dict(arch="qwen2", lora=True, matrix=True),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[matrix] if c.get("matrix") else [])
                                  for n, c in CASES.items()])
def test_trainer_with_protrain_trains_like_plain_deepspeed(name, tmp_path):
    if CASES[name].get("lora"):
        pytest.importorskip("peft")
    pt, ds = pair(CASES[name], tmp_path)
    assert_same_training(pt, ds, steps=6)
    check_case(name, pt, ds)


def test_save_and_resume_from_checkpoint(tmp_path):
    """The Trainer saves every 3 steps (DeepSpeed's save_checkpoint, the model, the RNG
    states); a new Trainer resumed from step 3 ends where the uninterrupted run did."""
    case = dict(arch="llama", save_steps=3, eval=True, protrain=True)
    first = hfmatrix.train(dict(case, name="first"), str(tmp_path))
    resumed = hfmatrix.train(dict(case, name="resumed", resume=str(tmp_path / "first" / "checkpoint-3")),
                             str(tmp_path))
    assert resumed["steps"] == first["steps"] == [1, 2, 3, 4, 5, 6]
    assert resumed["losses"] == first["losses"] and resumed["eval"] == first["eval"]
    assert all(torch.equal(resumed["weights"][n], w) for n, w in first["weights"].items())
    saved = first["saved"]                   # the model file of checkpoint-6: the final weights
    assert all(torch.equal(saved[n].float(), first["weights"][n]) for n in saved)


@matrix
def test_bf16_with_auto_values_trains_like_plain_deepspeed_within_bf16_error(tmp_path):
    """"bf16": {"enabled": "auto"} and the Trainer's --bf16: both engines train in bf16."""
    pt, ds = pair(dict(arch="llama", bf16=True), tmp_path)
    assert pt["engine"] == "ProTrainEngine" and pt["offloaded"] > 0
    for a, b in zip(pt["losses"], ds["losses"]):
        assert abs(a - b) <= 0.01 * abs(b)
    for n, w in ds["weights"].items():
        assert (pt["weights"][n] - w).abs().max() <= 0.03, n


# ---- transformers' run_clm.py path, as a script run from the command line -------------------
def _run_clm(tmp_path, name: str, protrain: bool, *extra: str) -> dict:
    ds_cfg = hfmatrix.ds_json({"protrain": protrain})
    if protrain:      # most chunks offloaded (the embedding is the largest parameter: 16 KiB)
        ds_cfg["protrain"].update(chunk_size="16KiB", n_persist=1)
    (tmp_path / f"{name}.json").write_text(json.dumps(ds_cfg))
    from dpworker import free_port
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / name
    cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "run_clm.py"),
           "--model_type", "llama", "--config_overrides",
           f"vocab_size={hfmatrix.VOCAB},hidden_size=32,intermediate_size=64,num_hidden_layers=2,"
           "num_attention_heads=4,num_key_value_heads=2,head_dim=8,max_position_embeddings=64",
           "--tokenizer_name", str(tmp_path / "tokenizer"), "--train_file", str(tmp_path / "train.txt"),
           "--validation_file", str(tmp_path / "valid.txt"), "--block_size", "16", "--do_train",
           "--do_eval", "--output_dir", str(out), "--per_device_train_batch_size", "2",
           "--per_device_eval_batch_size", "2", "--max_steps", "6", "--logging_steps", "1",
           "--learning_rate", "3e-3", "--save_steps", "3", "--deepspeed", str(tmp_path / f"{name}.json"),
           "--use_cpu", "--report_to", "none", "--disable_tqdm", "true", *extra]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    from safetensors.torch import load_file
    state = json.loads((out / "trainer_state.json").read_text())
    return {"losses": [h["loss"] for h in state["log_history"] if "loss" in h],
            "eval": json.loads((out / "eval_results.json").read_text()),
            "model": load_file(str(out / "model.safetensors")), "log": r.stdout + r.stderr}


@matrix
def test_a_run_clm_script_trains_unchanged_like_plain_deepspeed(tmp_path):
    hfmatrix.tokenizer().save_pretrained(str(tmp_path / "tokenizer"))
    rng = random.Random(0)
    for name, lines in (("train", 60), ("valid", 12)):
        (tmp_path / f"{name}.txt").write_text("\n".join(
            " ".join(f"w{rng.randrange(hfmatrix.VOCAB - 3)}" for _ in range(rng.randrange(5, 20)))
            for _ in range(lines)) + "\n")
    pt = _run_clm(tmp_path, "protrain", True)
    ds = _run_clm(tmp_path, "deepspeed", False)
    assert "ProTrain" not in ds["log"]
    assert len(pt["losses"]) == 6 and pt["losses"] == ds["losses"]
    assert pt["eval"]["eval_loss"] == ds["eval"]["eval_loss"]
    assert pt["eval"]["perplexity"] == ds["eval"]["perplexity"]
    assert all(torch.equal(pt["model"][n], w) for n, w in ds["model"].items())
    # --resume_from_checkpoint through the script: the same end
    resumed = _run_clm(tmp_path, "protrain", True, "--resume_from_checkpoint",
                       str(tmp_path / "protrain" / "checkpoint-3"))
    assert resumed["losses"] == pt["losses"] and resumed["eval"]["eval_loss"] == pt["eval"]["eval_loss"]
    assert all(torch.equal(resumed["model"][n], w) for n, w in pt["model"].items())


# ---- two ranks --------------------------------------------------------------------------------
TWO_RANKS = [
    # refused on both ranks at initialize: the world size named first (then what else breaks)
    dict(name="P=3", refuse=True, arch="no-position-ids", protrain_section={"sequence_parallel": 3}),
    # rank 0 alone plans and writes the plan file, rank 1 refuses too (no hang)
    dict(name="plan file", refuse=True, arch="llama", protrain_section={"plan_file": "PLAN"}),
    dict(name="llama, evaluation, WarmupLR, pad-to-longest", arch="llama", eval=True,
         scheduler=True, lengths="longest"),
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    (out / "a_file").write_text("x")
    cases = []
    for case in TWO_RANKS:
        if case.get("refuse"):
            section = {k: (str(out / "a_file" / "plan.json") if v == "PLAN" else v)
                       for k, v in case["protrain_section"].items()}
            cases.append(dict(case, protrain_section=section))
        else:
            cases += [dict(case, protrain=True, name=case["name"] + " protrain"),
                      dict(case, protrain=False, name=case["name"] + " deepspeed")]
    return out, hfmatrix.launch(2, cases, str(out))


def _two(out, runs, name):
    got = []
    for kind in ("protrain", "deepspeed"):
        rank0 = runs[0][f"{name} {kind}"]
        rank0.update(torch.load(out / f"weights-{name} {kind}.pt"))
        got.append(rank0)
    return got


def test_two_ranks_refuse_at_initialize_together(two_ranks):
    _, runs = two_ranks
    for r in runs:
        msg = r["P=3"]["refused"]
        assert msg.startswith("protrain.sequence_parallel = 3: P must divide the world size (2 ranks); "
                              "the model's forward takes no position_ids"), msg
        assert "Valid values for this launch and model: 1 " in msg
    assert "protrain.plan_file" in runs[0]["plan file"]["refused"]
    assert runs[1]["plan file"]["refused"].endswith("(refused on rank 0)")


def test_two_ranks_through_the_trainer_train_like_plain_deepspeed(two_ranks):
    out, runs = two_ranks
    name = TWO_RANKS[2]["name"]
    pt, ds = _two(out, runs, name)
    assert_same_training(pt, ds, steps=6)
    assert runs[0][f"{name} protrain"]["lengths"] != runs[1][f"{name} protrain"]["lengths"]


TWO_RANKS_MATRIX = {
    "mixtral (idle experts)": dict(arch="mixtral"),
    "gpt2 (tied)": dict(arch="gpt2"),
    "llama, PEFT LoRA": dict(arch="llama", lora=True),
    "llama, pad-to-longest, later batches longer": dict(arch="llama", lengths="growing"),
    # no evaluation: one right before a save gathers the sharded parameters (and hides the bug)
    "llama, saves every 2 steps": dict(arch="llama", save_steps=2),
    "llama, accumulation": dict(arch="llama", gas=2, scheduler=True),
}


@pytest.fixture(scope="module")
def two_ranks_matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("two-matrix")
    cases = []
    for name, case in TWO_RANKS_MATRIX.items():
        cases += [dict(case, protrain=True, name=f"{name} protrain"),
                  dict(case, protrain=False, name=f"{name} deepspeed")]
    saving = TWO_RANKS_MATRIX["llama, saves every 2 steps"]
    cases.append(dict(saving, protrain=True, name="resumed",
                      resume=str(out / "llama, saves every 2 steps protrain" / "checkpoint-2")))
    return out, hfmatrix.launch(2, cases, str(out))


@matrix
@pytest.mark.parametrize("name", ["mixtral (idle experts)", "gpt2 (tied)",
                                  "llama, PEFT LoRA", "llama, pad-to-longest, later batches longer",
                                  "llama, saves every 2 steps"])
def test_two_ranks_matrix(two_ranks_matrix, name):
    out, runs = two_ranks_matrix
    pt, ds = _two(out, runs, name)
    assert_same_training(pt, ds, steps=6)


@matrix
def test_two_ranks_resume_from_checkpoint(two_ranks_matrix):
    out, runs = two_ranks_matrix
    first = runs[0]["llama, saves every 2 steps protrain"]
    resumed = runs[0]["resumed"]
    assert resumed["steps"] == first["steps"] == [1, 2, 3, 4, 5, 6]
    assert resumed["losses"] == first["losses"]
    w1 = torch.load(out / "weights-llama, saves every 2 steps protrain.pt")["weights"]
    w2 = torch.load(out / "weights-resumed.pt")["weights"]
    assert all(torch.equal(w2[n], w) for n, w in w1.items())


@matrix
def test_two_ranks_with_accumulation_train_like_plain_deepspeed_within_rounding(two_ranks_matrix):
    """Offloaded chunks reduce each micro-batch's gradients over the ranks and add them up on
    the host (as ZeRO-2 does); ZeRO-0 adds them up first and reduces once: the same sum in
    another order, so the weights may differ in the last bit."""
    out, runs = two_ranks_matrix
    pt, ds = _two(out, runs, "llama, accumulation")
    assert pt["offloaded"] > 0 and len(pt["losses"]) == 6
    for a, b in zip(pt["losses"], ds["losses"]):
        assert abs(a - b) <= 1e-6 * abs(b)
    for n, w in ds["weights"].items():
        assert torch.allclose(pt["weights"][n], w, rtol=1e-6, atol=1e-7), n


@matrix
def test_two_ranks_the_trainer_saves_the_whole_model(two_ranks_matrix):
    out, _ = two_ranks_matrix
    pt = torch.load(out / "weights-llama, saves every 2 steps protrain.pt")
    ds = torch.load(out / "weights-llama, saves every 2 steps deepspeed.pt")
    assert all(torch.equal(pt["saved"][n], w) for n, w in ds["saved"].items())


def test_a_zero3_json_saves_the_whole_model_through_the_trainer(tmp_path):
    """A ZeRO-3 JSON with the section: trainer.save_model() writes the trained weights (it
    asked the engine for ZeRO-3's gathered weights, got 'not gathered' and wrote none)."""
    pt = hfmatrix.train(dict(arch="llama", protrain=True, zero3=True, steps=3), str(tmp_path))
    assert pt["engine"] == "ProTrainEngine" and pt["final_saved"] is not None
    for n, w in pt["weights"].items():
        assert torch.equal(pt["final_saved"][n].float(), w), n


def test_a_model_built_after_the_arguments_under_zero3_trains_like_deepspeed_zero3(tmp_path):
    """run_clm's order with a ZeRO-3 JSON: TrainingArguments first, then from_pretrained /
    from_config, which transformers then runs under zero.Init (every parameter partitioned).
    ProTrain refused it ("set stage <= 2"); now it gathers the parameters whole and trains:
    the logged losses are plain DeepSpeed ZeRO-3's on the same script, the weights within the
    rounding of ZeRO-3's flat-partition Adam (3e-8 measured), and save_model writes them."""
    pt = hfmatrix.train(dict(arch="llama", protrain=True, zero3=True, steps=3,
                             built_after_args=True, name="protrain"), str(tmp_path))
    ds = hfmatrix.train(dict(arch="llama", protrain=False, zero3=True, steps=3,
                             built_after_args=True, name="deepspeed"), str(tmp_path))
    assert pt["built_partitioned"] and ds["built_partitioned"]
    assert pt["engine"] == "ProTrainEngine" and pt["offloaded"]
    # ZeRO-3's Adam runs over its flat partition, whose SIMD blocks and scalar tail split
    # the elements elsewhere than per-tensor calls do: the weights differ in the last bits
    # after a step, and so may the next losses (equal on one VM, 3e-7 apart on an AMD EPYC).
    assert pt["losses"][0] == ds["losses"][0]
    assert torch.allclose(torch.tensor(pt["losses"]), torch.tensor(ds["losses"]), rtol=1e-6, atol=0)
    for n, w in ds["weights"].items():
        assert torch.allclose(pt["weights"][n], w, rtol=0, atol=1e-6), n
        assert torch.equal(pt["final_saved"][n].float(), pt["weights"][n]), n


def test_a_peft_model_takes_what_its_base_model_takes():
    """PEFT's forward passes **kwargs on to the model it wraps: the engine must see that it
    takes position_ids (sequence shards) and use_cache (turned off in training), while a bare
    **kwargs elsewhere says nothing of what the forward does with them."""
    peft = pytest.importorskip("peft")
    from torch import nn

    from protrain_ds.sequence_parallel import model_takes, unsupported_reason
    model = peft.get_peft_model(hfmatrix.tiny_model("llama"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    assert model_takes(model, "position_ids") and model_takes(model, "use_cache")
    assert unsupported_reason(model) is None
    assert not model_takes(model, "no_such_argument")

    class Opaque(nn.Module):
        def forward(self, x, **kwargs):
            return x
    assert not model_takes(Opaque(), "position_ids")

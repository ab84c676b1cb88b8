"""torch.compile under ProTrain (protrain.runtime.compile, protrain_ds/compile.py): every way a
script asks for it trains like plain DeepSpeed compiled with the same backend, with offloaded
chunks and checkpointed and swapped blocks; the blocks' forwards run compiled, and later steps
compile nothing new.

The backend is aot_eager (dynamo and AOT autograd as inductor sees them, without generating
C++): cheap enough for tests. bench/compile_compare.py runs inductor."""
from __future__ import annotations

import json

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

from dstrain import UNTIED, base_config, with_protrain

import deepspeed
from protrain.block_mode import BlockMode
from protrain.models import GPT, synthetic_batch
from protrain.runtime.activations import checkpointed_blocks
from protrain.runtime.compile import CompiledBlocks, CompileRequest, take_compiled

# Offloaded chunks streaming through 4 buffers; blocks S C C N (swap, checkpoint x2, keep),
# or with an SSD block: D S C N.
PINS = dict(chunk_size="110KiB", n_persist=2, n_buffer=4, n_swap=1, n_checkpoint=2)
SSD_PINS = dict(chunk_size="110KiB", n_persist=2, n_buffer=4, n_ssd=1, n_swap=1, n_checkpoint=1)
STEPS = 3


class CountingBackend:
    """aot_eager, counting the graphs dynamo hands it and the calls of the compiled forwards."""

    def __init__(self):
        self.__name__ = "counting_aot_eager"
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        compiled = lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)
        run._boxed_call = getattr(compiled, "_boxed_call", False)
        return run


def _train(form: str, protrain: bool, cache=None, ssd=None):
    """Train STEPS steps with the model compiled in ``form``; returns (losses, weights, engine,
    backend, per-step (graphs, calls)). ``cache``: profile cache directory (one profile
    serves the forms after the first: the same eager model); ``ssd``: a plan with an SSD
    block writing there."""
    torch._dynamo.reset()           # each run compiles afresh (and counts its own graphs)
    torch.manual_seed(0)
    model = GPT(UNTIED)
    backend = CountingBackend()
    pins = dict(SSD_PINS, ssd_path=ssd, ssd_min_bytes=0) if ssd else PINS
    cfg = with_protrain(base_config(), **pins, profile_cache_dir=cache) if protrain else base_config()
    passed = model
    if form == "torch.compile(model)":
        passed = torch.compile(model, backend=backend, fullgraph=True)
    elif form == "model.compile()":
        model.compile(backend=backend)
    engine, _, _, _ = deepspeed.initialize(model=passed, model_parameters=model.parameters(), config=cfg)
    if form == "engine.compile()":
        engine.compile(backend=backend)
    elif form == "regional module.compile()":      # accelerate's regional compilation
        for block in model.transformer.h:
            block.compile(backend=backend)
    losses, counts = [], []
    for i in range(STEPS):
        if form == "engine.compile() after step 1" and i == 1:
            engine.compile(backend=backend)
        x, y = synthetic_batch(UNTIED, 2, seed=i)
        before = backend.calls
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        counts.append((backend.graphs, backend.calls - before))
    state = model.state_dict()
    weights = {n: state[n].detach().clone() for n, _ in model.named_parameters()}
    return losses, weights, engine, backend, counts


FORMS = ["torch.compile(model)", "engine.compile()", "model.compile()",
         "regional module.compile()", "engine.compile() after step 1"]


def test_every_compile_form_trains_like_deepspeed_compiled(capsys, tmp_path):
    ref_losses, ref_weights, ref_engine, ref_backend, _ = _train("engine.compile()", protrain=False)
    assert ref_backend.graphs >= 1                     # plain DeepSpeed really compiled
    ref_engine.destroy()
    for form in FORMS:
        capsys.readouterr()
        ssd = str(tmp_path) if form == "engine.compile()" else None
        losses, weights, engine, backend, counts = _train(form, protrain=True, cache=str(tmp_path / "cache"),
                                                          ssd=ssd)
        modes = "DSCN" if ssd else "SCCN"
        assert "".join(m.letter for m in engine.protrain_plan.block_modes) == modes, form
        assert engine.protrain_runtime.chunks.offloaded(), form
        acts = engine.protrain_runtime.activations.stats
        assert acts["swapped_bytes"] > 0 and acts["prefetched_bytes"] > 0, form
        assert (acts["ssd_written_bytes"] > 0) == bool(ssd), form
        assert engine.protrain_runtime.compiled.compiled == [0, 1, 2, 3], form
        # Every block's forward ran compiled, the checkpointed ones twice (the recompute);
        # nothing else did (the code around the blocks is eager).
        compiled_steps = counts[1:] if form.endswith("after step 1") else counts
        for _, calls in compiled_steps:
            assert calls == 4 + modes.count("C"), (form, counts)
        # One graph for the four blocks, none after the first compiled step: moving chunks
        # between steps recompiles nothing.
        assert compiled_steps[0][0] == compiled_steps[-1][0] == 1, (form, counts)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, form
        for name, w in ref_weights.items():
            assert (weights[name] - w).abs().max() <= 1e-5, (form, name)
        assert losses[-1] < losses[0]
        out = capsys.readouterr().out
        assert out.count("ProTrain: torch.compile (") == 1, (form, out)    # said once
        assert "the forward of 4 of 4 blocks compiled" in out
        if form == "torch.compile(model)":
            assert "fullgraph per block" in out
        assert engine.is_compiled == form.startswith("engine.compile()")   # as DeepSpeed says
        engine.destroy()


def test_trainer_torch_compile_and_a_compiled_model_train_like_deepspeed(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from spworker import llama

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 4 * STEPS

        def __getitem__(self, i):
            ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    def run(name: str, protrain: bool, how: str):
        ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                         "betas": "auto", "eps": "auto"}},
              "zero_optimization": {"stage": 0}}
        if protrain:       # the second run loads the first one's profile
            ds = with_protrain(ds, chunk_size="192KiB", n_persist=1, n_swap=1, n_checkpoint=1,
                               profile_cache_dir=str(tmp_path / "cache"))
        (tmp_path / f"{name}.json").write_text(json.dumps(ds))
        torch.manual_seed(0)
        model = llama({"model": {"layers": 3}, "seq": 32})
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=STEPS, per_device_train_batch_size=4,
            logging_steps=1, learning_rate=1e-3, report_to="none", save_strategy="no",
            deepspeed=str(tmp_path / f"{name}.json"), use_cpu=True, disable_tqdm=True,
            lr_scheduler_type="constant", remove_unused_columns=False,   # a compiled forward has no signature
            torch_compile=how == "torch_compile=True",
            torch_compile_backend="aot_eager" if how == "torch_compile=True" else None)
        passed = torch.compile(model, backend="aot_eager") if how == "compiled model" else model
        trainer = transformers.Trainer(model=passed, args=args, train_dataset=Data())
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(Data())
        trainer.train()
        engine = trainer.model_wrapped
        state = engine.module.state_dict()
        weights = {n.removeprefix("_orig_mod."): t.detach().clone() for n, t in state.items()}
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        modes = engine.protrain_plan.block_modes if protrain else None
        compiled = engine.protrain_runtime.compiled.compiled if protrain else None
        engine.destroy()
        return losses, weights, modes, compiled

    ref_losses, ref_weights, _, _ = run("ds", False, "torch_compile=True")
    for how in ("torch_compile=True", "compiled model"):
        losses, weights, modes, compiled = run(how.replace(" ", "_"), True, how)
        assert modes == (BlockMode.SWAP, BlockMode.CKPT, BlockMode.NONE), how
        assert compiled == [0, 1, 2], how
        assert len(losses) == STEPS and losses == ref_losses, how   # the Trainer logs 4 digits
        for name, w in ref_weights.items():
            assert (weights[name] - w).abs().max() <= 1e-5, (how, name)


def test_blocks_whose_mode_cannot_be_compiled_run_eager_and_the_rest_compiled():
    torch.manual_seed(0)
    model = GPT(UNTIED)
    blocks = list(model.transformer.h)
    modes = [BlockMode.SWAP, BlockMode.CKPT, BlockMode.SELECTIVE, BlockMode.NONE]
    backend = CountingBackend()
    request = CompileRequest.from_options(backend, "engine.compile()")
    x, y = synthetic_batch(UNTIED, 2)
    torch.manual_seed(1)
    ref = model(x, y)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    compiled = CompiledBlocks(blocks, modes, request)
    with checkpointed_blocks(blocks, modes):         # as the runtime: checkpoint around compile
        loss = model(x, y)
        loss.backward()
    compiled.close()
    assert compiled.compiled == [0, 1, 3] and list(compiled.eager) == [2]
    assert "dispatch mode" in compiled.eager[2]
    line = compiled.summary()
    assert "the forward of 3 of 4 blocks compiled" in line and "block(s) 2 run eager" in line
    assert backend.calls == 3 + 1                    # block 1 recomputed through its compiled forward
    assert torch.equal(loss, ref)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-6, rtol=0), n
    assert all("forward" not in b.__dict__ for b in blocks)      # put back
    sp = CompiledBlocks(blocks, [BlockMode.NONE] * 4, request, sequence_parallel=2)
    assert sp.compiled == [] and "Ulysses" in sp.eager[0]
    sp.close()


def test_compile_wrappers_are_taken_off_with_their_options():
    backend = CountingBackend()
    model = GPT(UNTIED)
    eager, request = take_compiled(torch.compile(model, backend=backend, dynamic=False))
    assert eager is model
    assert (request.backend, request.source, request.dynamic) == ("counting_aot_eager",
                                                                  "torch.compile(model)", False)
    model.transformer.h[1] = torch.compile(model.transformer.h[1], backend="aot_eager")
    for block in model.transformer.h[2:]:
        block.compile(backend="eager", fullgraph=True)
    eager, request = take_compiled(model)
    assert isinstance(eager.transformer.h[1], type(eager.transformer.h[0]))
    assert all(m._compiled_call_impl is None for m in eager.modules())
    assert (request.backend, request.source) == ("aot_eager", "torch.compile(transformer.h.1)")
    assert take_compiled(model) == (model, None)
    # CUDA graphs replay fixed addresses: the blocks are compiled without them.
    for request in (CompileRequest.from_options("inductor", "engine.compile()", mode="reduce-overhead"),
                    CompileRequest.from_compiled(torch.compile(model, mode="max-autotune"), "x")):
        assert "CUDA graph" in request.changed
    assert CompileRequest.from_options("inductor", "e", mode="reduce-overhead").wrap.keywords["mode"] == "default"


def test_a_failure_while_profiling_a_compiled_model_names_protrain_compile_and_the_fix():
    class Failing(GPT):
        def forward(self, idx, targets=None, position_ids=None):
            raise TypeError("arange() received an invalid combination of arguments")

    torch.manual_seed(0)
    model = Failing(UNTIED)
    engine, _, _, _ = deepspeed.initialize(model=torch.compile(model, backend="aot_eager"),
                                           model_parameters=model.parameters(),
                                           config=with_protrain(base_config(), **PINS))
    assert engine.module is model                  # the engine holds the eager model
    x, y = synthetic_batch(UNTIED, 2)
    with pytest.raises(TypeError) as info:
        engine(x, y)
    note = "\n".join(info.value.__notes__)
    assert "ProTrain" in note and "torch.compile" in note and "torch.compile(model)" in note
    assert '"enabled": false' in note
    engine.destroy()


def test_deepcompile_and_a_compile_schedule_are_refused_saying_why():
    from protrain.config import ConfigError
    model = GPT(UNTIED)
    cfg = with_protrain(base_config(compile={"deepcompile": True}))
    with pytest.raises(ConfigError, match="compile.deepcompile"):
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=with_protrain(base_config()))
    with pytest.raises(ConfigError, match="schedule"):
        engine.compile(schedule=[(0, ["z3"])])
    engine.destroy()


def test_the_profiler_runs_compiled_pieces_eager_and_refuses_a_compiled_model():
    from protrain.models import GPTConfig
    from protrain.measure.profiler import profile_model
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    torch.manual_seed(0)
    model = GPT(cfg)
    backend = CountingBackend()
    for block in model.transformer.h:          # compiled pieces inside the model it is given
        block.compile(backend=backend)
    x, y = synthetic_batch(cfg, 2)
    profile = profile_model(model, lambda m: m(x, y), progress=False)
    assert len(profile.parts) == 2 + 2 and backend.graphs == backend.calls == 0
    with pytest.raises(TypeError, match=r"ProTrain profiles the eager model.*model\._orig_mod"):
        profile_model(torch.compile(model, backend=backend), lambda m: m(x, y), progress=False)

"""The DeepSpeed surface beyond the Trainer's happy path (issue 33), each against plain
DeepSpeed ZeRO-0 on the same script: optimizer sections with DeepSpeed's own defaults."""
import contextlib

import pytest
import torch

from dstrain import TINY, base_config, train, with_protrain

OFFLOADED = dict(chunk_size="64KiB", n_persist=1)


def run_steps(engine, start: int, n: int) -> list[float]:
    """Steps ``start`` .. ``start + n - 1`` of the TINY model's batches; their losses."""
    from protrain.models import synthetic_batch
    losses = []
    for i in range(start, start + n):
        x, y = synthetic_batch(TINY, 2, seed=i)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimizer", [
    {"type": "AdamW", "params": {"lr": 1e-3}},
    {"type": "Adam", "params": {"lr": 1e-3}},
    {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}},
    {"type": "AdamW"},
    {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
], ids=["AdamW", "Adam", "Adam-L2", "AdamW-no-params", "AdamW-torch"])
def test_an_optimizer_section_takes_deepspeeds_defaults(optimizer):
    """Without weight_decay DeepSpeed's FusedAdam / CPU Adam decay nothing (torch's AdamW would
    decay by 0.01; it does with torch_adam, in both)."""
    cfg = base_config(gradient_clipping=1.0, optimizer=optimizer)
    ds_losses, ds_weights, _ = train(cfg, steps=4)
    pt_losses, pt_weights, engine = train(with_protrain(cfg, **OFFLOADED), steps=4)
    assert engine.protrain_runtime.chunks.offloaded()
    assert pt_losses == ds_losses
    for name, w in ds_weights.items():
        assert torch.equal(pt_weights[name], w), name




@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True),
], ids=["AdamW", "AdamW-fused", "Adam-foreach", "Adam-decoupled"])
def test_a_client_torch_optimizer_is_run_as_torch_runs_it(make):
    """Plain DeepSpeed steps a script's own torch Adam/AdamW itself: ProTrain runs torch's
    arithmetic with the same flags (was DeepSpeed's CPU Adam kernel: 4.8e-7 apart)."""
    cfg = base_config(gradient_clipping=1.0)
    del cfg["optimizer"]
    ds_losses, ds_weights, _ = train(cfg, steps=4, optimizer=make)
    pt_losses, pt_weights, engine = train(with_protrain(cfg, **OFFLOADED), steps=4, optimizer=make)
    assert engine.protrain_runtime.chunks.offloaded()
    assert pt_losses == ds_losses
    for name, w in ds_weights.items():
        assert torch.equal(pt_weights[name], w), name


@pytest.mark.parametrize("json_optimizer, client", [
    (None, lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True)),
    (None, lambda ps: torch.optim.Adam(ps, lr=1e-3, maximize=True)),
    (None, lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)),
    (None, lambda ps: (lambda params: torch.optim.SGD(params, lr=1e-2))),
    ({"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": True, "torch_adam": True}}, None),
    ({"type": "Adagrad", "params": {"lr": 1e-2}}, None),
], ids=["AdamW-amsgrad", "Adam-maximize", "SGD", "SGD-callable", "json-amsgrad", "json-Adagrad"])
def test_an_optimizer_the_runtime_cannot_run_steps_aside_to_plain_deepspeed(json_optimizer, client, capsys):
    """An optimizer the chunk runtime does not run (was refused by name at initialize): plain
    DeepSpeed runs the engine with the JSON as written, saying so with the reason; the
    losses and weights are DeepSpeed's bit for bit."""
    from protrain_ds.engine import ProTrainEngine
    cfg = base_config(gradient_clipping=1.0, zero_optimization={"stage": 1}, zero_allow_untested_optimizer=True)
    if json_optimizer is None:
        del cfg["optimizer"]
    else:
        cfg["optimizer"] = json_optimizer
    ds_losses, ds_weights, _ = train(cfg, steps=3, optimizer=client)
    capsys.readouterr()
    pt_losses, pt_weights, engine = train(with_protrain(cfg, verbosity=1), steps=3, optimizer=client)
    assert not isinstance(engine, ProTrainEngine)
    out = capsys.readouterr().out
    assert "ProTrain steps aside" in out and "JSON as written" in out, out
    assert pt_losses == ds_losses
    for name, w in ds_weights.items():
        assert torch.equal(pt_weights[name], w), name


def test_a_job_resumed_from_a_checkpoint_runs_its_own_pins(tmp_path):
    """load_checkpoint into a fresh engine: the job plans at its first forward with its own
    pins (not the checkpoint's plan, which was run silently before) and goes on exactly."""
    import deepspeed
    from protrain.models import GPT
    cfg = base_config(gradient_clipping=1.0)
    ds_losses, ds_weights, _ = train(cfg, steps=6)

    def run(section, steps, load=None, save=None):
        torch.manual_seed(0)
        model = GPT(TINY)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=with_protrain(cfg, **section))
        start = 0
        if load:
            engine.load_checkpoint(load)
            start = engine.global_steps
            # The weights are there before the first forward (evaluation, state_dict).
            assert torch.equal(model.state_dict()["transformer.h.0.mlp.c_fc.weight"],
                               saved_weights["transformer.h.0.mlp.c_fc.weight"])
        losses = run_steps(engine, start, steps)
        if save:
            engine.save_checkpoint(save)
        state = model.state_dict()
        return losses, {n: state[n].clone() for n, _ in model.named_parameters()}, engine

    first, saved_weights, _ = run(OFFLOADED, 3, save=str(tmp_path))
    second, weights, engine = run(dict(n_persist="all", n_checkpoint=1), 3, load=str(tmp_path))
    knobs = engine.protrain_plan.knobs
    assert knobs.n_checkpoint == 1 and not engine.protrain_runtime.chunks.offloaded(), knobs
    assert first + second == ds_losses
    for name, w in ds_weights.items():
        assert torch.equal(weights[name], w), name


def test_an_engine_without_an_optimizer_runs_forward_as_deepspeed_does(capsys):
    """A reference model (TRL's DPO) or an evaluation before training: initialize without an
    optimizer. ProTrain steps aside, saying so, and plain DeepSpeed runs it; a training engine
    built on the same model afterwards is ProTrain's and trains like DeepSpeed."""
    import deepspeed
    from protrain.models import GPT, synthetic_batch
    from protrain_ds.engine import ProTrainEngine
    cfg = base_config(gradient_clipping=1.0)
    bare = {k: v for k, v in cfg.items() if k != "optimizer"}
    ds_losses, ds_weights, _ = train(cfg, steps=3)
    torch.manual_seed(0)
    model = GPT(TINY)
    x, y = synthetic_batch(TINY, 2, seed=0)
    plain, *_ = deepspeed.initialize(model=model, config=bare)
    with torch.no_grad():
        want = plain(x, y).item()
    section = dict(with_protrain(bare), protrain=dict(with_protrain(bare)["protrain"], verbosity=1))
    inference, *_ = deepspeed.initialize(model=model, config=section)
    assert not isinstance(inference, ProTrainEngine)
    assert "ProTrain steps aside" in capsys.readouterr().out
    with torch.no_grad():
        assert inference(x, y).item() == want
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=with_protrain(cfg, **OFFLOADED))
    assert isinstance(engine, ProTrainEngine)
    assert run_steps(engine, 0, 3) == ds_losses
    state = model.state_dict()
    for name, w in ds_weights.items():
        assert torch.equal(state[name], w), name


def _generate_after_a_step(protrain: bool, lora: bool):
    """A tiny Hugging Face Llama (LoRA on top with ``lora``) trained one step through the
    engine, then sampled greedily through model.generate (the model's own forward, not the
    engine's), as a script printing samples during training does."""
    import deepspeed
    import hfmatrix
    model = hfmatrix.tiny_model("llama")
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules=["q_proj", "v_proj"]))
    cfg = base_config()
    if protrain:
        cfg = with_protrain(cfg, **hfmatrix.offloading(model))
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    ids = torch.randint(3, hfmatrix.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids[:, :6], max_new_tokens=5, do_sample=False,
                             pad_token_id=0)
        logits = engine.module(input_ids=ids).logits
    return out, logits, engine


@pytest.mark.parametrize("lora", [False, True], ids=["llama", "llama-lora"])
def test_generate_and_module_calls_outside_the_engine_see_the_trained_weights(lora):
    """model.generate and engine.module(x) run the model's forward without the engine's call:
    the offloaded embedding and head were empty tensors there ("'weight' must be 2-D")."""
    if lora:
        pytest.importorskip("peft")
    ds_out, ds_logits, _ = _generate_after_a_step(False, lora)
    pt_out, pt_logits, engine = _generate_after_a_step(True, lora)
    assert engine.protrain_runtime.chunks.offloaded()
    assert torch.equal(pt_out, ds_out)
    assert torch.equal(pt_logits, ds_logits)


def _rank_alone(rank, world, port, out_dir):
    import json
    import os
    import time
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed
    from dstrain import UNTIED
    from protrain.models import GPT, synthetic_batch
    torch.manual_seed(0)
    model = GPT(UNTIED)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=with_protrain(base_config(), **OFFLOADED, gather_timeout=3))
    x, y = synthetic_batch(UNTIED, 2, seed=rank)
    engine.backward(engine(x, y))
    engine.step()
    got = {}
    if rank == 0:           # a sample on rank 0 alone: refused by name, not a hang
        t = time.monotonic()
        try:
            with torch.no_grad():
                engine.module(x, y)
        except RuntimeError as e:
            got["error"], got["waited"] = str(e), time.monotonic() - t
    torch.distributed.barrier()
    with torch.no_grad():   # on every rank: through the engine and outside it, the same
        got["engine"], got["module"] = engine(x, y).item(), engine.module(x, y).item()
    engine.backward(engine(x, y))      # and training goes on
    engine.step()
    engine.destroy()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


def test_a_forward_on_one_rank_alone_is_refused_by_name_not_a_hang(tmp_path):
    """Two ranks, sharded offloaded chunks: an evaluation forward on rank 0 alone would wait
    for ever in the gather of the other rank's shards (it hung); it fails after gather_timeout
    naming the ranks that did not come and the fix, and training goes on."""
    import json
    from ranks import start_ranks
    from dpworker import free_port
    start_ranks(_rank_alone, (2, free_port(), str(tmp_path)), 2)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert "rank(s) [1] did not call it within 3 s" in ranks[0]["error"], ranks[0]
    assert "on every rank" in ranks[0]["error"] and ranks[0]["waited"] < 30
    for r in ranks:
        assert r["engine"] == r["module"]


def test_a_checkpoint_saved_before_the_first_forward_resumes_like_deepspeed(tmp_path):
    """DeepSpeed saves before any step (a script's checkpoint at step 0); ProTrain refused
    ("nothing to checkpoint yet"). Saved, loaded into a fresh engine, trained: DeepSpeed's
    losses and weights; DeepSpeed's tag checks apply before anything is written."""
    import deepspeed
    from protrain.config import ConfigError
    from protrain.models import GPT
    cfg = base_config(gradient_clipping=1.0)
    ds_losses, ds_weights, _ = train(cfg, steps=3)
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=with_protrain(cfg, **OFFLOADED))
    with pytest.raises(ConfigError, match="checkpoint tag"):
        engine.save_checkpoint(str(tmp_path), tag="a/b")
    assert engine.save_checkpoint(str(tmp_path))
    torch.manual_seed(1)            # other initial weights: the checkpoint's must win
    model = GPT(TINY)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=with_protrain(cfg, **OFFLOADED))
    engine.load_checkpoint(str(tmp_path))
    assert run_steps(engine, 0, 3) == ds_losses
    state = model.state_dict()
    for name, w in ds_weights.items():
        assert torch.equal(state[name], w), name


def test_requires_grad_changed_between_a_load_and_the_first_forward_is_refused(tmp_path):
    """The states are checked against the trainable set at the load and taken at the first
    forward: a change in between would drop or misplace moments (parked ones, FusedAdam's
    counts), so that forward refuses it by name, before planning; set back, training goes on
    like DeepSpeed."""
    import deepspeed
    from protrain.models import GPT, synthetic_batch
    from protrain_ds.checkpoint import CheckpointError
    cfg = base_config(gradient_clipping=1.0)
    ds_losses, ds_weights, _ = train(cfg, steps=4)

    def engine_for():
        torch.manual_seed(0)
        model = GPT(TINY)
        return model, deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=with_protrain(cfg, **OFFLOADED))[0]

    steps = run_steps
    model, engine = engine_for()
    first = steps(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path))
    model, engine = engine_for()
    engine.load_checkpoint(str(tmp_path))
    head = model.transformer.h[0].mlp.c_fc.weight
    head.requires_grad_(False)
    x, y = synthetic_batch(TINY, 2, seed=2)
    with pytest.raises(CheckpointError, match=r"requires_grad of \['transformer.h.0.mlp.c_fc.weight'\] "
                                              r"changed between load_checkpoint"):
        engine(x, y)
    head.requires_grad_(True)
    assert first + steps(engine, 2, 2) == ds_losses
    state = model.state_dict()
    for name, w in ds_weights.items():
        assert torch.equal(state[name], w), name


def test_model_device_is_the_engines_while_the_first_parameter_is_offloaded(monkeypatch):
    """HF generate() (and much user code) puts its inputs on ``model.device``, which for a
    PreTrainedModel is the device of its first parameter. With that parameter in an offloaded
    chunk its data sits in host memory between uses, so on a GPU inputs went to the CPU. While
    the runtime holds the parameters, ``model.device`` (the inner model's too) is the engine's.
    On CPU the engine's device is the host as well, so this shows where the answer comes from:
    with the engine's device set to a stand-in ("meta") the model reports it, its first
    parameter still on the host and untouched; before the first forward and after destroy()
    (parameters where they are, no runtime) it is the parameter's device again, as in HF."""
    import deepspeed
    import hfmatrix
    meta = torch.device("meta")
    model = hfmatrix.tiny_model("llama")
    cfg = with_protrain(base_config(), **dict(hfmatrix.offloading(model), n_persist=0))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    first = next(model.parameters())
    with monkeypatch.context() as m:
        m.setattr(engine, "device", meta)
        assert model.device == torch.device("cpu")      # not planned yet: the parameter's
    ids = torch.randint(3, hfmatrix.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    chunks = engine.protrain_runtime.chunks
    c = next(c for c in chunks.chunks if any(s.param is first for s in c.slots))
    assert not c.persistent
    # between uses the parameter's data points into the chunk's host copy
    assert first.untyped_storage().data_ptr() == chunks.host_params(c).untyped_storage().data_ptr()
    with monkeypatch.context() as m:
        m.setattr(engine, "device", meta)
        assert model.device == meta and model.model.device == meta
        assert first.device == torch.device("cpu")
    assert model.device == engine.device
    engine.destroy()
    with monkeypatch.context() as m:
        m.setattr(engine, "device", meta)
        assert model.device == first.device == torch.device("cpu")


def test_the_optimizers_state_dict_calls_are_refused_naming_the_checkpoint_calls():
    """docs/deepspeed.md's table: ``engine.optimizer.state_dict()`` / ``load_state_dict()`` of
    plain DeepSpeed hand out or take its optimizer states; ProTrain's live in chunks sharded
    over the ranks, host memory or NVMe: refused, naming what saves and resumes them."""
    _, _, engine = train(with_protrain(base_config(), chunk_size="64KiB", n_persist=1), TINY, 1)
    with pytest.raises(NotImplementedError, match=r"engine\.save_checkpoint"):
        engine.optimizer.state_dict()
    with pytest.raises(NotImplementedError, match=r"engine\.load_checkpoint"):
        engine.optimizer.load_state_dict({})
    engine.destroy()


def test_a_step_before_any_forward_through_the_engine_is_refused_by_name():
    """docs/deepspeed.md's table: ProTrain plans at the first forward through the engine, so an
    ``engine.step()`` before any (a loop training through ``engine.module(x)``) is refused with
    what to do, not run on parameters that have no chunks yet."""
    import deepspeed
    from protrain.models import GPT, synthetic_batch
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=with_protrain(base_config()))
    x, y = synthetic_batch(TINY, 2)
    engine.module(x, y).backward()
    with pytest.raises(RuntimeError, match=r"before any forward.*engine\(batch\)"):
        engine.step()
    engine.destroy()


def _full_grads(model) -> dict:
    """``deepspeed.utils.safe_get_full_grad`` of every parameter: the tensor, None, or
    "refused" (NotImplementedError)."""
    from deepspeed.utils import safe_get_full_grad
    out = {}
    for n, p in model.named_parameters():
        try:
            g = safe_get_full_grad(p)
            out[n] = None if g is None else g.detach().float().cpu().clone()
        except NotImplementedError:
            out[n] = "refused"
    return out


def _by_hand(cfg: dict, by: str, ordinary: int, steps: int = 2, k: int = 3, rank: int = 0,
             grads: list | None = None):
    """``ordinary`` plain steps, then ``steps`` optimizer steps of ``k`` micro-batches each
    accumulated by hand as ``by`` says, with "gradient_accumulation_steps": 1 (``rank``'s
    batches). Returns (losses, weights, engine). ``grads``: gets ``_full_grads`` after every
    backward and after every step of those."""
    import contextlib

    import deepspeed
    from protrain.models import GPT, synthetic_batch
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = run_steps(engine, 100 * rank, ordinary)
    for i in range(ordinary, ordinary + steps * k):
        last = (i - ordinary) % k == k - 1
        if by == "no_sync":              # DeepSpeed's docs: the last micro-batch outside it
            ctx = contextlib.nullcontext() if last else engine.no_sync()
        elif by == "no_sync, step after":    # every micro-batch inside, step() outside
            ctx = engine.no_sync()
        elif by == "coalesce":
            ctx = contextlib.nullcontext()
        else:                            # set_gradient_accumulation_boundary / unmanaged
            ctx = contextlib.nullcontext()
            if by == "boundary":
                engine.set_gradient_accumulation_boundary(last)
        if by == "coalesce" and (i - ordinary) % k == 0:
            block = engine.coalesce_grad_reduction()
            block.__enter__()
        with ctx:
            x, y = synthetic_batch(TINY, 2, seed=100 * rank + i)
            loss = engine(x, y)
            engine.backward(loss)
            losses.append(loss.item())
        if grads is not None:
            grads.append(_full_grads(model))
        if last:
            if by == "coalesce":
                block.__exit__(None, None, None)
            engine.step()
            if grads is not None:
                grads.append(_full_grads(model))
    state = model.state_dict()
    return losses, {n: state[n].clone() for n, _ in model.named_parameters()}, engine


@pytest.mark.parametrize("by,ordinary,clip", [
    ("no_sync", 0, 1.0), ("no_sync", 2, 0.0), ("no_sync, step after", 2, 1.0),
    ("boundary", 2, 1.0), ("unmanaged", 0, 1.0), ("coalesce", 1, 1.0)])
def test_accumulating_by_hand_with_the_steps_at_1_trains_like_deepspeed(by, ordinary, clip):
    """DeepSpeed's ``no_sync()`` (its docs' loop), ``set_gradient_accumulation_boundary(False)``,
    ``coalesce_grad_reduction()`` and ``"managed_gradient_accumulation": false`` with
    ``"gradient_accumulation_steps": 1``: several backwards, then one step of their sum. Refused
    before (a boundary's gradients leave the device as the step's); now planned with
    accumulators - from the first plan, or re-planned at the forward that shows it after
    ordinary steps - and bit for bit plain DeepSpeed ZeRO-0 (coalesce: ZeRO-1/2/3 only in
    DeepSpeed, whose sum it is; compared with no_sync's)."""
    extra = {"managed_gradient_accumulation": False} if by == "unmanaged" else {}
    cfg = base_config(gradient_clipping=clip, **extra)
    ref_by = "no_sync" if by == "coalesce" else by
    ref = _by_hand(cfg, ref_by, ordinary)
    ref[2].destroy()
    pt_cfg = with_protrain(cfg, chunk_size="64KiB", n_persist=1)
    if by == "coalesce":
        pt_cfg["zero_optimization"] = {"stage": 2}
    losses, weights, engine = _by_hand(pt_cfg, by, ordinary)
    assert engine.protrain_runtime.chunks.offloaded()
    assert engine.protrain_runtime.optimizer.gas > 1          # accumulators held
    assert losses == ref[0]
    for name, w in ref[1].items():
        assert torch.equal(weights[name], w), name
    engine.destroy()


def _zero_grad_run(cfg):
    """DeepSpeed's no_sync loop with engine.zero_grad() dropping the first two micro-batches
    (a script discarding a bad stretch), then two more and the boundary; twice."""
    import deepspeed
    from protrain.models import GPT, synthetic_batch
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for step in range(2):
        for i in range(5):
            with engine.no_sync() if i < 4 else contextlib.nullcontext():
                x, y = synthetic_batch(TINY, 2, seed=10 * step + i)
                loss = engine(x, y)
                engine.backward(loss)
                losses.append(loss.item())
            if i == 1:
                engine.zero_grad()
        engine.step()
    state = model.state_dict()
    return losses, {n: state[n].clone() for n, _ in model.named_parameters()}, engine


def test_engine_zero_grad_drops_the_accumulated_gradients_as_deepspeed_does():
    """DeepSpeed ZeRO-0's engine.zero_grad() sets every p.grad to None: the micro-batches
    accumulated so far are dropped. ProTrain's gradients are in its chunks, where it did
    nothing (the step applied them: silently wrong); now they are dropped, bit for bit as
    DeepSpeed, and after the boundary's backward (its update has begun) it is refused."""
    cfg = base_config(gradient_clipping=1.0)
    ref = _zero_grad_run(cfg)
    ref[2].destroy()
    losses, weights, engine = _zero_grad_run(with_protrain(cfg, **OFFLOADED))
    assert engine.protrain_runtime.chunks.offloaded()
    assert losses == ref[0]
    for name, w in ref[1].items():
        assert torch.equal(weights[name], w), name
    from protrain.models import synthetic_batch
    x, y = synthetic_batch(TINY, 2, seed=99)
    engine.backward(engine(x, y))
    for zero_grad in (engine.zero_grad, engine.optimizer.zero_grad):
        with pytest.raises(RuntimeError, match=r"zero_grad\(\) \(the engine's or its optimizer's\) between the accumulation boundary"):
            zero_grad()
    engine.step()
    engine.zero_grad()                  # after the step: nothing to drop, as DeepSpeed
    engine.destroy()


def _offloaded_names(engine) -> set[str]:
    slot_of = engine.protrain_runtime.chunks.slot_of
    return {n for n, p in engine.module.named_parameters() if not slot_of[p][0].persistent}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_safe_get_full_grad_is_deepspeeds_where_protrain_holds_the_gradient(bf16):
    """``deepspeed.utils.safe_get_full_grad`` after every backward of DeepSpeed's no_sync loop
    and after step() (scripts log gradient norms so; DeepSpeed's TestNoSyncCtxt): bit for bit
    plain DeepSpeed ZeRO-0's under no_sync (persistent and offloaded chunks) and for persistent
    chunks after the boundary's backward; None after step() as DeepSpeed. Refused by name only
    for an offloaded chunk after the boundary's backward (CPU Adam has its gradients). In bf16
    ProTrain sums in fp32 where DeepSpeed ZeRO-0 sums in bf16: equal for one micro-batch, then
    within bf16's rounding."""
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    cfg = base_config(gradient_clipping=1.0, **extra)
    want, got = [], []
    # bf16: one step from the same weights (after a bf16 step the weights differ in bf16's
    # last bits, and Adam's early steps amplify that).
    ordinary, steps = (0, 1) if bf16 else (1, 2)
    ref = _by_hand(cfg, "no_sync", ordinary, steps=steps, grads=want)
    ref[2].destroy()
    _, _, engine = _by_hand(with_protrain(cfg, **OFFLOADED), "no_sync", ordinary, steps=steps, grads=got)
    offloaded = _offloaded_names(engine)
    assert offloaded and len(offloaded) < len(got[0])
    assert len(want) == len(got) == 4 * steps
    for i, (w, g) in enumerate(zip(want, got)):
        phase = i % 4                  # 0, 1: under no_sync; 2: the boundary; 3: after step()
        for name, expected in w.items():
            if phase == 3:
                assert expected is None and g[name] is None, (i, name)
            elif phase == 2 and name in offloaded:
                assert g[name] == "refused", (i, name)
            else:
                assert isinstance(g[name], torch.Tensor), (i, name)
                if bf16 and i > 0:               # summed in bf16 by DeepSpeed
                    tol = 2 ** -5 * expected.abs().max().item()
                    assert torch.allclose(g[name], expected, rtol=0, atol=tol), (i, name)
                else:
                    assert torch.equal(g[name], expected), (i, name)
    engine.destroy()


def _by_hand_rank(rank, world, port, out_dir):
    """One rank: DeepSpeed's no_sync loop after an ordinary step, plain ZeRO-0 then ProTrain."""
    import json
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    cfg = base_config(gradient_clipping=1.0)
    got = {}
    grads = {}
    for name, c in (("plain", cfg), ("protrain", with_protrain(cfg, **OFFLOADED))):
        grads[name] = []
        losses, weights, engine = _by_hand(c, "no_sync", 1, rank=rank, grads=grads[name])
        got[name] = [losses, {n: w.tolist() for n, w in weights.items()}]
        got[name + "_gas"] = getattr(getattr(engine, "protrain_runtime", None), "optimizer", None) \
            and engine.protrain_runtime.optimizer.gas
        if name == "protrain":
            offloaded = _offloaded_names(engine)
        engine.destroy()
    # safe_get_full_grad: the rank's own sums under no_sync, bit for bit in the first step, for
    # persistent chunks;
    # refused by name where ProTrain has reduced them (offloaded chunks; the boundary).
    verdicts = []
    for i, (w, g) in enumerate(zip(grads["plain"], grads["protrain"])):
        phase = i % 4
        for n, expected in w.items():
            if phase == 3:
                verdicts.append(expected is None and g[n] is None)
            elif phase == 2 or n in offloaded:
                verdicts.append(g[n] == "refused")
            elif i < 4:
                verdicts.append(isinstance(g[n], torch.Tensor) and torch.equal(g[n], expected))
            else:   # after a step whose weights are DeepSpeed's up to the reduction's rounding
                verdicts.append(isinstance(g[n], torch.Tensor)
                                and torch.allclose(g[n], expected, rtol=1e-5, atol=1e-6))
    got["grads_as_deepspeed"] = all(verdicts) and len(verdicts) == 8 * len(grads["plain"][0])
    got["grads_offloaded"] = len(offloaded)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


def test_accumulating_by_hand_on_two_ranks_trains_like_deepspeed(tmp_path):
    """The no_sync loop on two ranks (each its own batches): every rank re-plans with
    accumulators at the same forward (no hang), the weights stay equal over the ranks, and
    losses and weights are plain DeepSpeed ZeRO-0's up to the rounding of reducing each
    micro-batch rather than their sum. safe_get_full_grad under no_sync: the rank's own sum,
    bit for bit, for persistent chunks; refused by name for offloaded ones and at the
    boundary (reduced over the ranks by then)."""
    import json
    from ranks import start_ranks
    from dpworker import free_port
    start_ranks(_by_hand_rank, (2, free_port(), str(tmp_path)), 2)
    got = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for g in got:
        assert g["protrain_gas"] == 2
        assert g["grads_as_deepspeed"] and g["grads_offloaded"] > 0
        assert g["protrain"][0] == pytest.approx(g["plain"][0], rel=1e-6, abs=1e-7)
        for name, w in g["plain"][1].items():
            assert torch.allclose(torch.tensor(g["protrain"][1][name]), torch.tensor(w), atol=1e-6), name
    assert got[0]["protrain"][1] == got[1]["protrain"][1]


@pytest.mark.parametrize("by", ["two backwards", "no_sync after a backward"])
def test_accumulating_by_hand_after_a_boundary_backward_is_refused_by_name(by):
    """Two ``engine.backward`` calls before a step with no ``no_sync()`` (each is a boundary with
    the steps at 1), or ``no_sync()`` entered after a backward outside it: the first backward's
    offloaded gradients left the device as the step's and their updates may have begun - a
    second one trained silently wrong (weights 6e-3 apart from DeepSpeed's after 3 steps).
    Refused, naming what does it right."""
    import contextlib

    import deepspeed
    from protrain.models import GPT, synthetic_batch
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=with_protrain(
        base_config(gradient_clipping=0.0), chunk_size="64KiB", n_persist=1))
    run_steps(engine, 0, 2)                   # ordinary steps first: updates run during backward
    match = (r"second backward before engine\.step\(\).*engine\.no_sync\(\)" if by == "two backwards"
             else r"no_sync\(\).*began after a backward outside it.*gradient_accumulation_steps")
    with pytest.raises(RuntimeError, match=match):
        for m in range(2):
            x, y = synthetic_batch(TINY, 2, seed=10 + m)
            with engine.no_sync() if (m == 1 and by != "two backwards") else contextlib.nullcontext():
                engine.backward(engine(x, y))
    engine.destroy()


def test_requires_grad_changed_between_micro_batches_accumulated_by_hand_is_refused():
    """Under no_sync with the steps at 1 DeepSpeed's micro-step count says nothing: a change of
    the trainable set there would re-plan and drop the gradients held. Refused by name."""
    import deepspeed
    from protrain.models import GPT, synthetic_batch
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=with_protrain(
        base_config(), **OFFLOADED))
    with engine.no_sync():
        x, y = synthetic_batch(TINY, 2, seed=1)
        engine.backward(engine(x, y))
        model.transformer.wpe.weight.requires_grad_(False)
        with pytest.raises(RuntimeError, match="between micro-batches.*accumulated by hand"):
            engine(x, y)
    engine.destroy()


def test_coalesce_grad_reduction_keeps_deepspeeds_checks():
    """``coalesce_grad_reduction()`` as DeepSpeed has it: stage 0 in the JSON is its
    NotImplementedError, a step inside the block its no_sync assertion."""
    from protrain.models import synthetic_batch
    _, _, engine = train(with_protrain(base_config(), chunk_size="64KiB", n_persist=1), TINY, 1)
    with pytest.raises(NotImplementedError, match="requires ZeRO stage 1/2/3, got stage 0"):
        with engine.coalesce_grad_reduction():
            pass
    engine.protrain_zero_stage = 1
    with pytest.raises(AssertionError, match="illegal to call Engine.step"):
        with engine.coalesce_grad_reduction():
            x, y = synthetic_batch(TINY, 2, seed=5)
            engine.backward(engine(x, y))
            engine.step()
    assert not engine.inside_no_sync_ctxt
    engine.destroy()


def test_accumulation_under_no_sync_as_accelerate_drives_it_trains_like_deepspeed():
    """accelerate's ``accumulate()`` with DeepSpeed (a plain accelerate loop on several
    processes): the micro-batches before the boundary run under ``engine.no_sync()``, the
    boundary is set explicitly (``set_gradient_accumulation_boundary``) and ``step()`` follows
    the boundary's backward only - with ``"gradient_accumulation_steps": 3``, bit for bit plain
    DeepSpeed's."""
    import contextlib

    import deepspeed
    from protrain.models import GPT, synthetic_batch

    def run(cfg):
        torch.manual_seed(0)
        model = GPT(TINY)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = []
        for i in range(9):
            boundary = i % 3 == 2
            with contextlib.nullcontext() if boundary else engine.no_sync():
                engine.set_gradient_accumulation_boundary(boundary)
                x, y = synthetic_batch(TINY, 2, seed=i)
                loss = engine(x, y)
                engine.backward(loss)
                losses.append(loss.item())
            if boundary:
                engine.step()
        state = model.state_dict()
        engine.destroy()
        return losses, {n: state[n].clone() for n, _ in model.named_parameters()}
    cfg = base_config(gradient_clipping=0.0, gradient_accumulation_steps=3)
    ref = run(cfg)
    got = run(with_protrain(cfg, chunk_size="64KiB", n_persist=1))
    assert got[0] == ref[0]
    assert all(torch.equal(got[1][n], w) for n, w in ref[1].items())


@pytest.mark.parametrize("save_dir", ["", None])
def test_save_checkpoint_without_a_directory_is_refused_as_deepspeed_does(save_dir, tmp_path, monkeypatch):
    """DeepSpeed raises ValueError for an empty or missing save_dir; ProTrain wrote "" into the
    current directory (found running DeepSpeed's tests/unit/checkpoint with the section)."""
    monkeypatch.chdir(tmp_path)
    _, _, engine = train(with_protrain(base_config(), chunk_size="64KiB", n_persist=1), TINY, 1)
    with pytest.raises(ValueError, match="save_dir must be a non-empty"):
        engine.save_checkpoint(save_dir)
    engine.destroy()
    assert list(tmp_path.iterdir()) == []


def _zero_init_rank(rank, world, port, out_dir):
    """One rank: plain DeepSpeed ZeRO-0 on a model built as usual; then the same model built
    under zero.Init (what transformers does with a ZeRO-3 JSON) with the ZeRO-3 JSON and the
    section, without an optimizer (an evaluation) and with one (training)."""
    import json
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed
    from protrain.models import GPT, synthetic_batch
    from protrain_ds import zero_init
    from protrain_ds.engine import ProTrainEngine
    cfg = base_config(gradient_clipping=1.0)
    zero3 = dict(cfg, zero_optimization={"stage": 3})
    x, y = synthetic_batch(TINY, 2, seed=rank)

    def built(under_zero_init: bool):
        torch.manual_seed(0)
        if not under_zero_init:
            return GPT(TINY)
        with deepspeed.zero.Init(config_dict_or_path=zero3):
            return GPT(TINY)

    def steps(engine):
        losses = []
        for i in range(3):
            xi, yi = synthetic_batch(TINY, 2, seed=10 * i + rank)
            loss = engine(xi, yi)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        state = engine.module.state_dict()
        return losses, {n: state[n].float().sum().item() for n in sorted(state)}

    got = {}
    model = built(True)
    # The reference: the weights zero.Init left (a model's own init under zero.Init may see
    # empty tensors), gathered into the model built as usual.
    reference = built(False)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        reference.load_state_dict({n: p.data.clone() for n, p in model.named_parameters()},
                                  strict=False)
    plain, *_ = deepspeed.initialize(model=reference, model_parameters=reference.parameters(),
                                     config=cfg)
    with torch.no_grad():
        got["plain_eval"] = plain(x, y).item()
    got["plain"] = steps(plain)
    evaluation, *_ = deepspeed.initialize(model=model, config={
        k: v for k, v in with_protrain(zero3).items() if k != "optimizer"})
    got["eval_engine"] = [type(evaluation).__name__, evaluation.zero_optimization_stage()]
    with torch.no_grad():
        got["eval"] = evaluation(x, y).item()
    model = built(True)
    assert any(hasattr(p, "ds_id") for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=with_protrain(zero3, **OFFLOADED))
    got["engine"] = isinstance(engine, ProTrainEngine)
    got["left"] = sorted({k for p in model.parameters() for k in vars(p) if k.startswith("ds_")
                          or k in zero_init.ZERO3_ATTRIBUTES})
    got["protrain"] = steps(engine)
    got["offloaded"] = bool(engine.protrain_runtime.chunks.offloaded())
    engine.destroy()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


def test_a_model_built_under_zero_init_trains_like_deepspeed(tmp_path):
    """transformers builds the model under zero.Init when the JSON says ZeRO-3 (run_clm): it was
    refused ("set stage <= 2"). Two ranks, each holding half of every parameter: ProTrain gathers
    them whole and trains bit for bit as plain DeepSpeed ZeRO-0 on the model built as usual;
    without an optimizer ProTrain steps aside and DeepSpeed runs the JSON's ZeRO-3."""
    import json
    from ranks import start_ranks
    from dpworker import free_port
    start_ranks(_zero_init_rank, (2, free_port(), str(tmp_path)), 2)
    for r in range(2):
        got = json.load(open(tmp_path / f"rank{r}.json"))
        assert got["eval_engine"] == ["DeepSpeedEngine", 3], got["eval_engine"]
        assert got["eval"] == got["plain_eval"]
        assert got["engine"] and got["offloaded"]
        assert got["left"] == [], got["left"]          # no ZeRO-3 bookkeeping left on them
        assert got["protrain"] == got["plain"]


def _tags_rank(rank, world, port, out_dir):
    import json
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed
    from protrain.models import GPT
    got = {}
    for mode in ("FAIL", "WARN"):
        torch.manual_seed(0)
        model = GPT(TINY)
        cfg = with_protrain(base_config(checkpoint={"tag_validation": mode}), **OFFLOADED)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        got[mode + "_losses"] = run_steps(engine, 0, 2)
        where = os.path.join(out_dir, mode)
        try:
            engine.save_checkpoint(where, tag=f"tag-{rank}")
            got[mode] = "saved"
        except AssertionError as e:
            got[mode] = f"AssertionError: {e}"
        got[mode + "_files"] = sorted(os.listdir(where)) if os.path.isdir(where) else []
        if got[mode] == "saved":
            torch.manual_seed(1)
            fresh = GPT(TINY)
            again, *_ = deepspeed.initialize(model=fresh, model_parameters=fresh.parameters(),
                                             config=cfg)
            again.load_checkpoint(where)
            got[mode + "_resumed"] = run_steps(again, 2, 2)
            got[mode + "_continued"] = run_steps(engine, 2, 2)
            again.destroy()
        engine.destroy()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


def test_tags_that_differ_between_ranks_follow_tag_validation(tmp_path):
    """Ranks saving under different tags (a rank number in the tag): DeepSpeed's
    checkpoint.tag_validation FAIL raises AssertionError on every rank, WARN (its default)
    saves. ProTrain failed on every mode with a missing-file error; now FAIL raises as
    DeepSpeed does and writes nothing, WARN saves every rank's files under rank 0's tag, and
    that checkpoint resumes training exactly."""
    import json
    from ranks import start_ranks
    from dpworker import free_port
    start_ranks(_tags_rank, (2, free_port(), str(tmp_path)), 2)
    for r in range(2):
        got = json.load(open(tmp_path / f"rank{r}.json"))
        assert got["FAIL"].startswith("AssertionError") and "not consistent" in got["FAIL"], got
        assert "rank 1: 'tag-1'" in got["FAIL"], got["FAIL"]
        assert got["FAIL_files"] == [], got["FAIL_files"]
        assert got["WARN"] == "saved" and got["WARN_files"] == ["latest", "tag-0"], got
        assert got["WARN_resumed"] == got["WARN_continued"]


def test_deepspeeds_full_tensor_accessors_are_refused_by_name_not_none():
    """Where ProTrain holds no such tensor: safe_get_full_grad(p) answered None (a script's norm logger, AdaLoRA's
    update_and_allocate then failed on None far from the cause); each accessor now names
    itself and the calls that give the same information. A parameter pickled meanwhile loads
    (without them), and after destroy() the parameters are DeepSpeed's again."""
    import io
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad,
                                 safe_get_full_optimizer_state, safe_set_full_fp32_param)
    from protrain.models import GPT, synthetic_batch
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, *_ = deepspeed_init(model, with_protrain(base_config(), **OFFLOADED))
    x, y = synthetic_batch(TINY, 2, seed=0)
    engine.backward(engine(x, y))
    # A parameter of an offloaded chunk: after the boundary's backward CPU Adam has its gradient.
    name = sorted(_offloaded_names(engine))[0]
    p = dict(model.named_parameters())[name]
    calls = {"get_full_hp_grad": lambda: safe_get_full_grad(p),
             "get_full_hp_param": lambda: safe_get_full_fp32_param(p),
             "exp_avg": lambda: safe_get_full_optimizer_state(p, "exp_avg"),
             "set_full_hp_param": lambda: safe_set_full_fp32_param(p, torch.zeros_like(p))}
    for words, call in calls.items():
        with pytest.raises(NotImplementedError, match="ProTrain") as e:
            call()
        assert words in str(e.value) and "get_global_grad_norm" in str(e.value)
    engine.step()
    buf = io.BytesIO()
    torch.save(p, buf)
    buf.seek(0)
    assert safe_get_full_grad(torch.load(buf, weights_only=False)) is None
    engine.destroy()
    assert safe_get_full_grad(p) is None and not hasattr(p, "_hp_mapping")


def deepspeed_init(model, cfg):
    import deepspeed
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)


def test_initialize_without_a_model_raises_deepspeeds_assertion():
    import deepspeed
    with pytest.raises(AssertionError, match="requires a model"):
        deepspeed.initialize(model=None, config=with_protrain(base_config()))


@pytest.mark.parametrize("optimizer_states", [True, False])
def test_a_save_between_a_load_and_the_first_forward_saves_what_was_loaded(tmp_path, optimizer_states):
    """DeepSpeed saves right after a load (a job that copies its resume point first); ProTrain
    refused it. The loaded states (or, with load_optimizer_states=False, the loaded weights and
    fresh moments) are saved, and a job resumed from that copy trains on as the original."""
    import deepspeed
    from protrain.models import GPT
    cfg = with_protrain(base_config(gradient_clipping=1.0), **OFFLOADED)

    def fresh(seed):
        torch.manual_seed(seed)
        model = GPT(TINY)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return engine

    original = fresh(0)
    run_steps(original, 0, 2)
    original.save_checkpoint(str(tmp_path / "a"))
    loaded = fresh(1)
    loaded.load_checkpoint(str(tmp_path / "a"), load_optimizer_states=optimizer_states)
    assert loaded.save_checkpoint(str(tmp_path / "b"))
    if not optimizer_states:           # the reference: the same load, trained on directly
        original = fresh(2)
        original.load_checkpoint(str(tmp_path / "a"), load_optimizer_states=False)
    resumed = fresh(3)
    resumed.load_checkpoint(str(tmp_path / "b"))
    assert resumed.global_steps == 2
    assert run_steps(resumed, 2, 2) == run_steps(original, 2, 2)
    a, b = original.module.state_dict(), resumed.module.state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for e in (original, loaded, resumed):
        e.destroy()


def test_exclude_frozen_parameters_leaves_their_values_out_as_deepspeed_does(tmp_path):
    """save_checkpoint(exclude_frozen_parameters=True) was accepted and ignored: the frozen
    values were saved and a load overwrote the loading model's. Now they are left out (the
    loading model keeps its own), the trained ones resume, and a load that would train a
    parameter saved frozen is still refused."""
    import deepspeed
    from protrain.models import GPT
    from protrain_ds.checkpoint import CheckpointError
    cfg = with_protrain(base_config(), **OFFLOADED)

    def fresh(seed):
        torch.manual_seed(seed)
        model = GPT(TINY)
        model.transformer.wpe.weight.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=[
            p for p in model.parameters() if p.requires_grad], config=cfg)
        return model, engine

    model, engine = fresh(0)
    run_steps(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path / "all"))
    engine.save_checkpoint(str(tmp_path / "trainable"), exclude_frozen_parameters=True)
    trained = model.state_dict()
    for name, own_frozen in (("all", False), ("trainable", True)):
        other, again = fresh(1)
        before = other.transformer.wpe.weight.detach().clone()
        again.load_checkpoint(str(tmp_path / name))
        state = other.state_dict()
        assert torch.equal(state["transformer.wpe.weight"], before if own_frozen else trained["transformer.wpe.weight"]), name
        assert torch.equal(state["transformer.wte.weight"], trained["transformer.wte.weight"]), name
        again.destroy()
    torch.manual_seed(2)
    unfrozen = GPT(TINY)
    third, *_ = deepspeed.initialize(model=unfrozen, model_parameters=unfrozen.parameters(), config=cfg)
    with pytest.raises(CheckpointError, match="wpe.weight"):
        third.load_checkpoint(str(tmp_path / "trainable"))
    engine.destroy()


def _config_forms(cfg: dict, tmp_path):
    """The ways DeepSpeed takes a config: the keyword arguments of initialize for each."""
    import argparse
    import base64
    import json
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return {
        "dict": dict(config=cfg),
        "path": dict(config=str(path)),
        "base64": dict(config=base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()),
        "config_params": dict(config_params=cfg),
        "args.deepspeed_config": dict(args=argparse.Namespace(deepspeed_config=str(path), local_rank=0)),
    }


@pytest.mark.parametrize("form", ["dict", "path", "base64", "config_params", "args.deepspeed_config"])
def test_every_way_to_pass_the_config_trains_like_deepspeed(form, tmp_path):
    """deepspeed.initialize's config forms, with a scheduler section and training_data (the
    returned dataloader): the section is read from each, and ProTrain trains bit for bit as
    plain DeepSpeed given the same form."""
    import deepspeed
    from protrain.models import GPT, synthetic_batch
    from protrain_ds.engine import ProTrainEngine
    cfg = base_config(gradient_clipping=1.0, scheduler={"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2}})
    x, y = synthetic_batch(TINY, 8, seed=0)
    data = torch.utils.data.TensorDataset(x, y)
    runs = {}
    for name, config in (("deepspeed", cfg), ("protrain", with_protrain(cfg, **OFFLOADED))):
        torch.manual_seed(0)
        model = GPT(TINY)
        (tmp_path / name).mkdir()
        engine, optimizer, loader, scheduler = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), training_data=data,
            **_config_forms(config, tmp_path / name)[form])
        assert isinstance(engine, ProTrainEngine) == (name == "protrain")
        assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler is not None
        losses = []
        for xb, yb in loader:
            loss = engine(xb, yb)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs[name] = (losses, scheduler.get_last_lr(), {n: p.detach().clone() for n, p in
                                                        model.state_dict().items()})
    assert len(runs["deepspeed"][0]) == 4
    assert runs["protrain"][:2] == runs["deepspeed"][:2]
    for n, w in runs["deepspeed"][2].items():
        assert torch.equal(runs["protrain"][2][n], w), n

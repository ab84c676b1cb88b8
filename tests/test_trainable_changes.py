"""requires_grad changed between optimizer steps (staged fine-tuning) trains exactly as plain
DeepSpeed ZeRO-0 does, bit for bit, with offloaded chunks, speculating under clipping and with
accumulation: parameters unfrozen later are updated (FusedAdam's group step count, their
moments from where they were), those frozen later stop (no step on zeros), and freezing a
param group's last parameter restarts the group's count as FusedAdam's does. What cannot be
exact is refused by name. The two-rank run is in one launch of its own."""
import pytest
import torch

import dstrain
from dpworker import launch_runs, train_run

MODEL = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64, tie_embeddings=False)
EMBED = ["transformer.wte", "transformer.wpe"]
LOWER = EMBED + ["transformer.h.0.", "transformer.h.1."]
OFFLOADED = dict(chunk_size="64KiB", n_persist=1, cpu_adam_threads=1)
SPECULATING = dict(OFFLOADED, speculate_chunks=99)
CLIP = {"gradient_clipping": 1.0}
SCENARIOS = {
    # the embeddings and the lower half frozen for 3 steps, then unfrozen
    "unfreeze": dict(steps=7, frozen=LOWER, requires_grad=[(3, LOWER, True)]),
    # the optimizer holds what trained at initialize (the Trainer's way); block 0 frozen for
    # two steps and unfrozen; the token embedding, outside the optimizer, stays frozen
    "subset": dict(steps=7, frozen=EMBED[:1], optimizer_over="trainable",
                   requires_grad=[(2, ["transformer.h.0."], False), (4, ["transformer.h.0."], True)]),
    # the embeddings, block 0 and the head (the param group's last parameter: the group's step
    # count restarts) frozen after 2 steps; the head back at 6 (its count resumes: a jump, its
    # beta^t by pow()), the rest at 8 (the count goes on from the jump's)
    "freeze later": dict(steps=10, requires_grad=[(2, EMBED + ["transformer.h.0.", "lm_head"], False),
                                                  (6, ["lm_head"], True),
                                                  (8, EMBED + ["transformer.h.0."], True)]),
}


def spec(scenario: str, clip: bool, protrain: dict | None, **extra) -> dict:
    s = dict(dict(model=MODEL, global_batch=2, **SCENARIOS[scenario]), **extra)
    if clip:          # a factor that leaves some steps under the threshold: commits and rollbacks
        s.update(extra=dict(CLIP, **s.get("extra", {})), loss_factor=0.4)
    return dict(s, protrain=protrain)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One compute thread: a tiny model's operators gain nothing from more, and on a busy
    machine two threads spinning on each other make every pass ten times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(name, spec) -> (result, weights), each run once per module, in this process."""
    out = tmp_path_factory.mktemp("trainable")
    done = {}

    def one(name: str, s: dict):
        if name not in done:
            d = out / name.replace(" ", "-").replace(",", "")
            d.mkdir()
            if s.get("protrain") is not None:        # each trainable set profiled once
                s = dict(s, protrain=dict(s["protrain"], profile_cache_dir=str(out / "profiles")))
            result, _ = train_run(0, 1, s, str(d))
            done[name] = (result, torch.load(d / "weights.pt"))
        return done[name]
    one.out = out
    return one


def same(a, b) -> bool:
    return a[0]["losses"] == b[0]["losses"] and all(torch.equal(w, b[1][n]) for n, w in a[1].items())


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipping"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_requires_grad_changed_between_steps_trains_like_deepspeed_bit_for_bit(run, scenario, clip):
    pins = SPECULATING if clip else OFFLOADED
    got = run(f"{scenario}, {clip}", spec(scenario, clip, pins))
    want = run(f"{scenario}, {clip}, deepspeed", spec(scenario, clip, None))
    assert got[0]["offloaded"] > 0
    assert same(got, want)
    if clip:                 # updates ran during backward, committed or redone
        assert got[0]["overlapped_chunks"] + got[0]["rollbacks"] > 0
    if scenario == "subset":    # the token embedding, frozen throughout, never moved
        torch.manual_seed(0)
        initial = dstrain.GPT(dstrain.GPTConfig(**MODEL)).transformer.wte.weight
        assert torch.equal(got[1]["transformer.wte.weight"], initial.detach())

def test_with_accumulation_too(run):
    acc = dict(extra={"gradient_accumulation_steps": 2}, steps=14, requires_grad=[(6, LOWER, True)])
    got = run("unfreeze, accumulation", spec("unfreeze", True, SPECULATING, **acc))
    want = run("unfreeze, accumulation, deepspeed", spec("unfreeze", True, None, **acc))
    assert same(got, want)


def test_a_checkpoint_taken_while_frozen_resumes_the_parked_states(run, engine):
    """Saved after the head and the embeddings were frozen (their moments and FusedAdam's
    counts held outside the chunks), resumed in a new engine that unfreezes them later: the
    same bits as the run that never stopped. Resuming with the head trainable is refused."""
    out = run.out
    first = spec("freeze later", False, OFFLOADED, save=str(out / "ckpt"), save_at=4)
    first["steps"] = 4
    run("freeze later, first half", first)
    second = spec("freeze later", False, OFFLOADED, load=str(out / "ckpt"), start=4)
    second.update(steps=6, frozen=EMBED + ["transformer.h.0.", "lm_head"])
    resumed = run("freeze later, resumed", second)
    whole = run("freeze later, False, deepspeed", spec("freeze later", False, None))
    assert resumed[0]["losses"] == whole[0]["losses"][4:]
    assert all(torch.equal(w, whole[1][n]) for n, w in resumed[1].items())
    _, eng, _ = engine(frozen=EMBED + ["transformer.h.0."], groups=lambda m: m.parameters())
    with pytest.raises(Exception, match=r"saved with parameters \['lm_head\.weight'\] frozen"):
        eng.load_checkpoint(str(out / "ckpt"))


def test_in_bf16_a_frozen_parameter_stands_still_and_resumes_from_its_fp32_master(engine):
    """16-bit: no bit-for-bit reference (DeepSpeed's bf16 wrapper steps flat copies made at
    initialize: it would move the frozen weights on zeros), so what the fp32 rule means: the
    frozen weights do not move, and once unfrozen they train on from their parked fp32
    masters (not from their bf16 rounding), with the count of steps taken."""
    from protrain.models import GPTConfig, synthetic_batch
    model, eng, step = engine(bf16={"enabled": True})
    step(0)
    step(1)
    frozen = [model.transformer.h[0].mlp.c_fc.weight, model.lm_head.weight]
    eng.protrain_sync()
    masters = [master_of(eng, p) for p in frozen]
    assert any(not torch.equal(m, p.detach().float()) for m, p in zip(masters, frozen))
    for p in frozen:
        p.requires_grad_(False)
    held = [p.detach().clone() for p in frozen]
    step(2)
    step(3)
    assert all(torch.equal(p.detach(), h) for p, h in zip(frozen, held))
    assert all(p not in eng.protrain_runtime.chunks.slot_of for p in frozen)
    for p in frozen:
        p.requires_grad_(True)
    x, y = synthetic_batch(GPTConfig(**MODEL), 2, seed=4)
    loss = eng(x, y)                                  # the layout for the new set, built here
    assert all(torch.equal(master_of(eng, p), m) for p, m in zip(frozen, masters))
    assert {eng.protrain_runtime.chunks.slot_of[p][1].step for p in frozen} == {4}
    eng.backward(loss)
    eng.step()
    assert all(not torch.equal(p.detach(), h) for p, h in zip(frozen, held))


def master_of(eng, p) -> torch.Tensor:
    """The fp32 master of ``p`` in its chunk (one rank: an offloaded chunk's shard is whole)."""
    c, s = eng.protrain_runtime.chunks.slot_of[p]
    with eng.protrain_runtime.chunks.host_states(c):
        return c.master[s.offset:s.stop].clone()


# ---- refused by name ----------------------------------------------------------------------------
@pytest.fixture
def engine(run, request):
    """engine(gas=1, frozen=(), groups=None, **ds) -> (model, engine, step(i) running micro-batch i)."""
    import deepspeed
    from dpworker import set_trainable
    from protrain.models import GPT, GPTConfig, synthetic_batch
    cfg = GPTConfig(**MODEL)

    def make(gas: int = 1, frozen=(), groups=None, **extra):
        torch.manual_seed(0)
        model = GPT(cfg)
        set_trainable(model, frozen, False)
        ds = dstrain.with_protrain(dstrain.base_config(gradient_accumulation_steps=gas, **extra), **OFFLOADED,
                                   profile_cache_dir=str(run.out / "profiles"))
        held = groups(model) if groups else [p for p in model.parameters() if p.requires_grad]
        eng, *_ = deepspeed.initialize(model=model, model_parameters=held, config=ds)
        request.addfinalizer(eng.destroy)

        def step(i: int):
            x, y = synthetic_batch(cfg, 2, seed=i)
            eng.backward(eng(x, y))
            eng.step()
        return model, eng, step
    return make


def test_unfreezing_a_parameter_the_optimizer_does_not_hold_is_refused(engine):
    model, eng, step = engine(frozen=EMBED[:1])          # the optimizer over the trainable ones
    step(0)
    model.transformer.wte.weight.requires_grad_(True)
    with pytest.raises(Exception, match=r"transformer\.wte\.weight.*no param group"):
        step(1)


def test_a_change_between_micro_batches_of_one_step_is_refused(engine):
    model, eng, step = engine(gas=2)
    step(0)
    model.transformer.h[0].attn.c_attn.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"between micro-batches.*micro-batch 2 of 2"):
        step(1)


def test_a_change_between_a_forward_and_its_backward_is_refused(engine):
    from protrain.models import GPTConfig, synthetic_batch
    model, eng, step = engine()
    step(0)
    x, y = synthetic_batch(GPTConfig(**MODEL), 2, seed=1)
    loss = eng(x, y)
    model.transformer.h[0].attn.c_attn.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"frozen \['transformer\.h\.0\.attn\.c_attn\.weight'\].*this backward"):
        eng.backward(loss)


def test_param_groups_that_would_count_apart_are_refused(engine):
    """Two groups; freezing group 0's last parameter restarts FusedAdam's count of group 0 only."""
    def halves(model):
        params = list(model.parameters())
        return [{"params": params[:20]}, {"params": params[20:]}]
    model, eng, step = engine(groups=halves)
    step(0)
    last = list(model.parameters())[19]
    last.requires_grad_(False)
    with pytest.raises(Exception, match=r"different counts \(\[0, 1\]"):
        step(1)


def test_the_runtime_refuses_a_training_forward_under_a_stale_layout():
    """Driven directly (no adapter to re-plan): refused, naming the parameter; an evaluation
    forward (no autograd) runs."""
    from protrain.models import GPT, synthetic_batch
    from test_runtime import CFG, build, step
    torch.manual_seed(0)
    model = GPT(CFG)
    rt = build(model)
    x, y = synthetic_batch(CFG, 2, seed=0)
    step(rt, model, x, y)
    model.lm_head.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"frozen \['lm_head\.weight'\].*this training forward"):
        with rt.forward_context():
            model(x, y)
    with torch.no_grad(), rt.forward_context():
        model(x, y)
    rt.close()


def test_two_ranks_change_together_like_deepspeed_and_refuse_changing_apart(tmp_path):
    """One launch: the freeze-later schedule on two ranks (offloaded chunks sharded, states
    exchanged at each change) trains DeepSpeed's bits; a change made on rank 1 alone is
    refused on both ranks, naming the parameter, at the forward that would diverge."""
    apart = spec("subset", False, OFFLOADED, steps=3, expect_error=True,
                 requires_grad=[(1, ["transformer.h.0.ln_1"], False, 1)])
    runs = {"apart": apart,
            "deepspeed": spec("freeze later", True, None),
            "protrain": spec("freeze later", True, SPECULATING)}
    runs = {name: dict(one, threads=1) for name, one in runs.items()}
    got = launch_runs(2, runs, str(tmp_path))
    for r in (0, 1):
        assert "ranks train different parameters" in got["apart"][r]["error"]
        assert "transformer.h.0.ln_1.weight" in got["apart"][r]["error"] and "ranks [0]" in got["apart"][r]["error"]
    assert got["protrain"][0]["losses"] == got["deepspeed"][0]["losses"]
    assert got["protrain"][1]["losses"] == got["deepspeed"][1]["losses"]
    a, b = (torch.load(tmp_path / name / "weights.pt") for name in ("protrain", "deepspeed"))
    assert all(torch.equal(w, b[n]) for n, w in a.items())
    assert got["protrain"][0]["offloaded"] > 0

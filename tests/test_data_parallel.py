"""Two ranks (gloo on CPU) train like one rank on the same global batch, and shard the host
states of offloaded chunks."""
import pytest
import torch

from dpworker import launch, launch_runs

MODEL = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64, tie_embeddings=False)
PLANS = {
    "no offloaded chunks": dict(chunk_size="230KiB", n_persist=5, n_swap=0, n_checkpoint=0),
    "offloaded chunks, swap and checkpoint": dict(chunk_size="230KiB", n_persist=1, n_buffer=2,
                                                  n_swap=1, n_checkpoint=1),
}


@pytest.mark.parametrize("plan", list(PLANS))
def test_two_ranks_match_one_rank_on_the_same_global_batch(plan, tmp_path):
    spec = dict(model=MODEL, global_batch=4, steps=20, protrain=PLANS[plan])
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = launch(1, spec, str(tmp_path / "one"))[0]
    two = launch(2, spec, str(tmp_path / "two"))
    assert two[0]["plan"] == two[1]["plan"]              # rank 0 planned, every rank runs it
    # Both ranks on this host: each prices and runs CPU Adam on half of its cores.
    for r, ranks in [(one, 1)] + [(t, 2) for t in two]:
        host = r["host"]
        assert host["ranks_per_node"] == host["plan_ranks_per_node"] == ranks
        assert host["kernel_threads"] == max(1, host["node_cores"] // ranks)
    # No process group outlives a rank's teardown (the cause of a rare abort at exit).
    assert all(r["process_groups_left"] == [] for r in [one] + two)
    for step, loss in enumerate(one["losses"]):
        mean = (two[0]["losses"][step] + two[1]["losses"][step]) / 2
        assert mean == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    w1 = torch.load(tmp_path / "one" / "weights.pt")
    w2 = torch.load(tmp_path / "two" / "weights.pt")
    for name, w in w1.items():
        assert torch.allclose(w2[name], w, atol=1e-4, rtol=1e-4), name
    if one["offloaded"]:
        # each rank keeps half of the offloaded chunks' host states (up to shard padding)
        for r in two:
            assert r["host_bytes"] == pytest.approx(one["host_bytes"] / 2, rel=0.01)


# Loss factors for DeepSpeed's default clipping at 1.0 on MODEL with a global batch of 4: every
# global gradient norm under 1.0 (speculation always right), or norms falling through 1.0 (the
# steps that clip stop the next one's speculation; a speculated step that clips rolls back).
REGIMES = {"under the threshold": 0.25, "around the threshold": 0.8}
SPECULATING = dict(PLANS["offloaded chunks, swap and checkpoint"], speculate_chunks=99)
# Of the 5 chunks: one whole on each device, two sharded over the ranks' devices, two offloaded.
SHARDED = dict(SPECULATING, n_persist=3, n_shard=2)


# (micro-batch, tokens) of each rank's batch per micro-step: ranks see different lengths in
# one step (a pad-to-longest collator), longer than the first, and a smaller last batch.
SHAPES = [[[2, 16], [2, 16]], [[2, 16], [2, 40]], [[2, 64], [2, 16]], [[2, 40], [2, 24]], [[1, 12], [1, 8]]]
# Two micro-steps per optimizer step: the 40-token batch comes second in its step.
SHAPES_ACCUMULATING = SHAPES[:4]
SHAPE_PINS = dict(chunk_size="110KiB", n_swap=0, n_checkpoint=0, sequence_parallel=1, accounting=True)
# Parameters without a gradient every other step (tests/sparse_models.py; the one-rank runs
# and the plans' reasons are in test_sparse_gradients.py).
BRANCH = dict(model=MODEL, global_batch=4, steps=8, kind="branch", extra={"gradient_clipping": 1.0},
              loss_factor=0.6)
BRANCH_CACHED = dict(chunk_size="64KiB", n_persist=1, n_buffer=22, n_swap=0, n_checkpoint=0,
                     speculate_chunks=0)
MOE = dict(model=dict(MODEL, n_layer=2), global_batch=4, steps=6, kind="moe",
           extra={"gradient_clipping": 1.0}, loss_factor=0.5)
LLAMA = dict(vocab=128, hidden=64, ffn=128, layers=2)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank launch, runs in turn: plain DeepSpeed ZeRO-0 and ProTrain (CPU Adam
    speculating on every offloaded chunk, copies as late as CUDA may run them) in both
    regimes, 20 steps each; batches that change shape (``SHAPES``): DeepSpeed ZeRO-0 and
    ProTrain at P = 1 (at a device budget where the 16-token plan keeps every chunk on the
    device and the 64-token one cannot), and with gradient accumulation at P = 2; with
    gradient accumulation, ProTrain speculating against ProTrain whose CPU Adam waits for the
    end of backward; a branch taken every other step and a mixture of experts, against
    DeepSpeed; and a Hugging Face Trainer whose weights are saved every way
    (tests/saveworker.py)."""
    clip = {"gradient_clipping": 1.0}
    runs = {}
    for regime, factor in REGIMES.items():
        spec = dict(model=MODEL, global_batch=4, steps=20, loss_factor=factor, extra=clip)
        runs[f"deepspeed {regime}"] = dict(spec, protrain=None)
        runs[f"protrain {regime}"] = dict(spec, deferred_streams=True, protrain=SPECULATING,
                                          save_16bit=True)
    runs["sharded around the threshold"] = dict(runs["protrain around the threshold"],
                                                protrain=SHARDED)
    shapes = dict(model=MODEL, global_batch=4, steps=len(SHAPES), batches=SHAPES)
    runs["deepspeed shapes"] = dict(shapes, protrain=None)
    runs["protrain shapes"] = dict(shapes, deferred_streams=True, protrain=SHAPE_PINS, budget_between=[16, 64],
                                   device_backend=True)
    accumulating = dict(model=MODEL, global_batch=4, steps=len(SHAPES_ACCUMULATING),
                        batches=SHAPES_ACCUMULATING, extra=dict(gradient_accumulation_steps=2))
    runs["deepspeed shapes, accumulation"] = dict(accumulating, protrain=None)
    runs["protrain shapes, accumulation"] = dict(accumulating, deferred_streams=True, protrain=dict(
        PLANS["offloaded chunks, swap and checkpoint"], sequence_parallel=2))
    gas = dict(model=MODEL, global_batch=4, steps=24, loss_factor=0.3,
               extra=dict(clip, gradient_accumulation_steps=2))
    runs["accumulation, waiting"] = dict(gas, protrain=dict(SPECULATING, speculate_chunks=0))
    runs["accumulation, speculating"] = dict(gas, deferred_streams=True, protrain=SPECULATING)
    runs["accumulation, sharded"] = dict(gas, deferred_streams=True, protrain=SHARDED)
    runs["branch, deepspeed"] = dict(BRANCH, protrain=None)
    runs["branch, offloaded"] = dict(BRANCH, protrain=dict(BRANCH_CACHED))
    runs["branch, speculating"] = dict(BRANCH, deferred_streams=True,
                                       protrain=dict(BRANCH_CACHED, n_buffer=8, speculate_chunks=99))
    runs["moe, deepspeed"] = dict(MOE, protrain=None)
    for again in ("first", "again"):
        runs[f"moe, {again}"] = dict(MOE, protrain=dict(BRANCH_CACHED, n_buffer=8, speculate_chunks=99,
                                                         host_thread=True))
    runs["saves"] = dict(saves=True, steps=3, model=LLAMA,
                         protrain=dict(chunk_size="32KiB", n_persist=1, gather_timeout=3))
    out = tmp_path_factory.mktemp("two_ranks")
    for name in ("branch, offloaded", "branch, speculating", "moe, first", "moe, again"):
        runs[name]["protrain"]["profile_cache_dir"] = str(out / "profiles")   # once per model
    return out, launch_runs(2, runs, str(out))


@pytest.mark.parametrize("regime", list(REGIMES))
def test_two_ranks_speculating_under_clipping_equal_deepspeed_zero0_exactly(regime, two_ranks):
    """The clipping norm is all-reduced over both ranks' shards (DeepSpeed's arithmetic to the
    bit: protrain/runtime/optimizer.py, _sharded_norms); a speculated step that clips is
    rolled back and redone on both ranks."""
    out, runs = two_ranks
    ref, got = runs[f"deepspeed {regime}"], runs[f"protrain {regime}"]
    for a, b in zip(ref, got):
        assert a["losses"] == b["losses"]
    w1 = torch.load(out / f"deepspeed {regime}" / "weights.pt")
    w2 = torch.load(out / f"protrain {regime}" / "weights.pt")
    assert all(torch.equal(w2[n], w) for n, w in w1.items())
    # the 16-bit export right after the last step (updates still running, shards on two
    # ranks): the whole trained model
    exported = torch.load(out / f"protrain {regime}" / "16bit" / "model.bin")
    assert set(exported) >= set(w1) and all(torch.equal(exported[n].float(), w) for n, w in w1.items())
    norms = got[0]["norms"]
    assert len(norms) == 20 and got[1]["norms"] == norms           # one global norm
    assert got[0]["offloaded"] > 0 and all(r["races"] == 0 for r in got)
    assert all(r["overlapped_chunks"] > 0 for r in got)
    # the persistent chunk's all-reduce ran under backward, from the plan's second step on
    assert all(r["reductions_overlapped"] == 19 for r in got), [r["reductions_overlapped"] for r in got]
    if regime == "under the threshold":
        assert max(norms) < 1.0 and all(r["rollbacks"] == 0 for r in got)
    else:
        assert min(norms) < 1.0 < max(norms) and all(r["rollbacks"] > 0 for r in got)


def test_two_ranks_with_sharded_persistent_chunks_equal_deepspeed_zero0_exactly(two_ranks):
    """Chunks kept on the devices sharded over the ranks (1/world of their states each, gathered
    into a buffer ahead of use, gradients reduce-scattered, device Adam on the shard), beside
    whole and offloaded ones, under clipping that speculates and rolls back: DeepSpeed ZeRO-0's
    bits; with accumulation, the bits of the plan that offloads them instead (the same
    reduce-scatter, then the sum over micro-steps)."""
    out, runs = two_ranks
    ref, got = runs["deepspeed around the threshold"], runs["sharded around the threshold"]
    assert all(r["sharded"] == 2 and r["offloaded"] == 2 and r["races"] == 0 for r in got)
    for a, b in zip(ref, got):
        assert a["losses"] == b["losses"]
    w1 = torch.load(out / "deepspeed around the threshold" / "weights.pt")
    w2 = torch.load(out / "sharded around the threshold" / "weights.pt")
    assert all(torch.equal(w2[n], w) for n, w in w1.items())
    assert got[0]["norms"] == got[1]["norms"] == runs["protrain around the threshold"][0]["norms"]
    # the chunks' device states and buffers are what the memory model counts (a sharded
    # chunk: half of a whole one's on each of the two ranks)
    assert all(r["device_state_bytes"] == r["planned_state_bytes"] for r in got)
    sync, sharded = runs["accumulation, waiting"], runs["accumulation, sharded"]
    assert all(r["sharded"] == 2 and r["races"] == 0 for r in sharded)
    for a, b in zip(sync, sharded):
        assert a["losses"] == b["losses"]
    w1 = torch.load(out / "accumulation, waiting" / "weights.pt")
    w2 = torch.load(out / "accumulation, sharded" / "weights.pt")
    assert all(torch.equal(w2[n], w) for n, w in w1.items())


def test_two_ranks_with_accumulation_speculating_equal_the_runtime_that_waits(two_ranks):
    """With gradient accumulation each micro-step's gradients are reduce-scattered (summed over
    ranks, then over micro-steps: ZeRO-3's order, not ZeRO-0's, so the comparison is with
    ProTrain itself): only the boundary speculates, every copy held back until waited for, and
    training is exactly the synchronous path's."""
    out, runs = two_ranks
    sync, late = runs["accumulation, waiting"], runs["accumulation, speculating"]
    assert all(r["overlapped_chunks"] == r["rollbacks"] == 0 for r in sync)
    assert all(r["overlapped_chunks"] > 0 for r in late)
    assert late[0]["offloaded"] > 0 and all(r["most_pending_copies"] > 0 for r in late)
    # no side work read what compute wrote after the events it waits for (the reduce-scatter
    # reads the chunk buffer's padding, zeroed on the compute stream)
    assert all(r["races"] == 0 for r in late)
    for a, b in zip(sync, late):
        assert a["losses"] == b["losses"]
    w1 = torch.load(out / "accumulation, waiting" / "weights.pt")
    w2 = torch.load(out / "accumulation, speculating" / "weights.pt")
    assert all(torch.equal(w2[n], w) for n, w in w1.items())
    # no process group outlives the launch's last run (the cause of a rare abort at exit)
    assert all(r["process_groups_left"] == [] for r in runs[list(runs)[-1]])


def test_two_ranks_plan_together_for_a_longer_batch_on_one_of_them(two_ranks):
    """Each rank sees its own lengths; the longest over both decides, so both re-plan at the
    same micro-step (the 40 tokens of rank 1) to the same plan, which offloads chunks the
    16-token plan kept whole on the device (their states move to chunks sharded over the ranks:
    kept on the devices, 1/2 each, or offloaded to the hosts). Losses
    and weights are DeepSpeed ZeRO-0's bit for bit, every copy held back as long as CUDA may,
    and each rank's device bytes stay within the plan in force at every step. The shape goes
    over a gloo group of its own, as with NCCL."""
    out, runs = two_ranks
    ref, got = runs["deepspeed shapes"], runs["protrain shapes"]
    for a, b in zip(ref, got):
        assert a["losses"] == b["losses"]
    w1 = torch.load(out / "deepspeed shapes" / "weights.pt")
    w2 = torch.load(out / "protrain shapes" / "weights.pt")
    assert all(torch.equal(w2[n], w) for n, w in w1.items())
    plans = got[0]["plans"]
    assert got[1]["plans"] == plans and [p[0] for p in plans] == [16, 64, 64, 64, 64]
    whole = [p[3] - p[-1] for p in plans]              # n_persist - n_shard
    assert whole[1] < whole[0] and got[0]["offloaded"] + got[0]["sharded"] > 0
    for r in got:
        assert r["races"] == 0 and all(0 < peak <= bound for peak, bound in r["peaks"]), r["peaks"]
        assert r["host_group"]            # its own gloo group (the world's is used when gloo)
    assert not any(r["host_group"] for r in runs["protrain shapes, accumulation"])


def test_two_ranks_keep_the_accumulated_gradients_over_a_replan_at_degree_two(two_ranks):
    """The sequence-parallel forward (P = 2, gather and rotate) re-plans too. The longer batch
    is the second micro-step of its optimizer step: the first one's gradients (persistent
    chunks' averaged over the ranks first, offloaded shards as they are) move into the new
    plan on both ranks, and the script's loss factor learnt by the first plan is kept.
    Sequence shards add up in another order, and offloaded chunks sum over ranks before
    micro-steps (ZeRO-3's order): DeepSpeed ZeRO-0 is matched to rounding."""
    out, runs = two_ranks
    ref, got = runs["deepspeed shapes, accumulation"], runs["protrain shapes, accumulation"]
    assert [p[:2] for p in got[0]["plans"]] == [[16, 2]] + [[64, 2]] * 3 and got[0]["global_steps"] == 2
    for a, b in zip(ref, got):
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-5)
    w1 = torch.load(out / "deepspeed shapes, accumulation" / "weights.pt")
    w2 = torch.load(out / "protrain shapes, accumulation" / "weights.pt")
    assert all(torch.allclose(w2[n], w, atol=1e-5, rtol=1e-5) for n, w in w1.items())


def _same_run(out, runs, a, b) -> bool:
    wa, wb = (torch.load(out / name / "weights.pt") for name in (a, b))
    return all(x["losses"] == y["losses"] for x, y in zip(runs[a], runs[b])) and \
        all(torch.equal(wb[n], w) for n, w in wa.items())


@pytest.mark.parametrize("run", ["branch, offloaded", "branch, speculating"])
def test_two_ranks_with_a_branch_taken_every_other_step_equal_deepspeed_zero0_exactly(run, two_ranks):
    """Every other step the embeddings and block 0 run frozen and block 1 without its MLP:
    their parameters get no gradient and are stepped on zeros, as DeepSpeed's all-reduce fills
    them. With 22 buffers the frozen part's chunks stay cached through the step (their update
    must not be read from the stale copy); with 8, backward prefetches them; speculating,
    updates run during backward and some are rolled back."""
    out, runs = two_ranks
    assert _same_run(out, runs, "branch, deepspeed", run)
    got = runs[run]
    assert got[0]["offloaded"] > 0 and all(r["races"] == 0 for r in got if r["races"] is not None)
    if run == "branch, speculating":
        assert all(r["overlapped_chunks"] > 0 and r["rollbacks"] > 0 for r in got)


def test_two_ranks_of_a_mixture_of_experts_train_the_same_bits_twice_and_like_deepspeed(two_ranks):
    """Experts that get tokens on one rank only, or on none; CPU Adam on a worker thread."""
    out, runs = two_ranks
    assert _same_run(out, runs, "moe, first", "moe, again")
    assert _same_run(out, runs, "moe, deepspeed", "moe, first")


SAVED = {  # file: how it was written (tests/saveworker.py; rank 0 writes, every rank calls)
    "module_state_dict.pt": "engine.module.state_dict()",
    "accelerate.safetensors": "accelerator.get_state_dict(engine)",
    "16bit/model.bin": "engine.save_16bit_model(dir)",
    "pretrained/model.safetensors": "unwrapped.save_pretrained(dir, is_main_process=rank == 0)",
    "trainer/model.safetensors": "trainer.save_model(dir)",
}


def _tensors(path):
    if path.suffix == ".safetensors":
        import safetensors.torch
        return safetensors.torch.load_file(path)
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("name", list(SAVED))
def test_two_ranks_save_the_trained_weights_every_way(name, two_ranks):
    """A Trainer on 2 ranks, offloaded chunks sharded over them (their parameters hold no
    values between steps): each save path writes every trained weight in full."""
    out, runs = two_ranks
    assert all(r["offloaded"] > 0 and r["empty_between_steps"] > 0 for r in runs["saves"])
    trained = torch.load(out / "saves" / "trained.pt")       # gathered by engine.destroy()
    saved = _tensors(out / "saves" / name)
    assert set(saved) == set(trained)
    assert all(torch.equal(saved[n], w) for n, w in trained.items())


@pytest.mark.parametrize("folder", ["trainer", "pretrained"])
def test_two_rank_saves_load_with_from_pretrained(folder, two_ranks):
    import transformers
    out, _ = two_ranks
    trained = torch.load(out / "saves" / "trained.pt")
    model = transformers.LlamaForCausalLM.from_pretrained(out / "saves" / folder)
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())


def test_no_file_written_holds_an_empty_tensor_and_a_save_on_one_rank_is_refused(two_ranks):
    """save_pretrained on rank 0 only (what some scripts do) cannot gather: it fails, naming
    the rank that never came and the way out, instead of hanging or writing empty tensors."""
    out, runs = two_ranks
    files = [f for f in (out / "saves").rglob("*") if f.suffix in (".safetensors", ".bin", ".pt")]
    assert len(files) >= len(SAVED) + 1
    for f in files:
        if f.name != "training_args.bin":
            assert all(t.numel() > 0 for t in _tensors(f).values()), f
    refused = runs["saves"][0]["refused"]
    assert refused is not None and "rank(s) [1] did not call it within 3 s" in refused
    assert "python -m protrain_ds.checkpoint" in refused and "trainer.save_model()" in refused
    assert not (out / "saves" / "rank0_only" / "model.safetensors").exists()

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


# (micro-batch, tokens) of each rank's batch per micro-step: ranks see different lengths in
# one step (a pad-to-longest collator), longer than the first, and a smaller last batch.
SHAPES = [[[2, 16], [2, 16]], [[2, 16], [2, 40]], [[2, 64], [2, 16]], [[2, 40], [2, 24]], [[1, 12], [1, 8]]]
# Two micro-steps per optimizer step: the 40-token batch comes second in its step.
SHAPES_ACCUMULATING = SHAPES[:4]
SHAPE_PINS = dict(chunk_size="110KiB", n_swap=0, n_checkpoint=0, sequence_parallel=1, accounting=True)


@pytest.fixture(scope="module")
def clipped_runs(tmp_path_factory):
    """One 2-rank launch, runs in turn: plain DeepSpeed ZeRO-0 and ProTrain (CPU Adam
    speculating on every offloaded chunk, copies as late as CUDA may run them) in both
    regimes, 20 steps each; batches that change shape (``SHAPES``): DeepSpeed ZeRO-0 and
    ProTrain at P = 1 (at a device budget where the 16-token plan keeps every chunk on the
    device and the 64-token one cannot), and with gradient accumulation at P = 2; and, with
    gradient accumulation, ProTrain speculating against ProTrain whose CPU Adam waits for the
    end of backward."""
    clip = {"gradient_clipping": 1.0}
    runs = {}
    for regime, factor in REGIMES.items():
        spec = dict(model=MODEL, global_batch=4, steps=20, loss_factor=factor, extra=clip)
        runs[f"deepspeed {regime}"] = dict(spec, protrain=None)
        runs[f"protrain {regime}"] = dict(spec, deferred_streams=True, protrain=SPECULATING,
                                          save_16bit=True)
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
    # last: its ranks report the process groups left after teardown
    runs["accumulation, speculating"] = dict(gas, deferred_streams=True, protrain=SPECULATING)
    out = tmp_path_factory.mktemp("clipped")
    return out, launch_runs(2, runs, str(out))


@pytest.mark.parametrize("regime", list(REGIMES))
def test_two_ranks_speculating_under_clipping_equal_deepspeed_zero0_exactly(regime, clipped_runs):
    """The clipping norm is all-reduced over both ranks' shards (DeepSpeed's arithmetic to the
    bit: protrain/runtime/optimizer.py, _sharded_norms); a speculated step that clips is
    rolled back and redone on both ranks."""
    out, runs = clipped_runs
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
    if regime == "under the threshold":
        assert max(norms) < 1.0 and all(r["rollbacks"] == 0 for r in got)
    else:
        assert min(norms) < 1.0 < max(norms) and all(r["rollbacks"] > 0 for r in got)


def test_two_ranks_with_accumulation_speculating_equal_the_runtime_that_waits(clipped_runs):
    """With gradient accumulation each micro-step's gradients are reduce-scattered (summed over
    ranks, then over micro-steps: ZeRO-3's order, not ZeRO-0's, so the comparison is with
    ProTrain itself): only the boundary speculates, every copy held back until waited for, and
    training is exactly the synchronous path's."""
    out, runs = clipped_runs
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
    assert all(r["process_groups_left"] == [] for r in late)


def test_two_ranks_plan_together_for_a_longer_batch_on_one_of_them(clipped_runs):
    """Each rank sees its own lengths; the longest over both decides, so both re-plan at the
    same micro-step (the 40 tokens of rank 1) to the same plan, which offloads chunks the
    16-token plan kept on the device (states move from replicated to sharded chunks). Losses
    and weights are DeepSpeed ZeRO-0's bit for bit, every copy held back as long as CUDA may,
    and each rank's device bytes stay within the plan in force at every step. The shape goes
    over a gloo group of its own, as with NCCL."""
    out, runs = clipped_runs
    ref, got = runs["deepspeed shapes"], runs["protrain shapes"]
    for a, b in zip(ref, got):
        assert a["losses"] == b["losses"]
    w1 = torch.load(out / "deepspeed shapes" / "weights.pt")
    w2 = torch.load(out / "protrain shapes" / "weights.pt")
    assert all(torch.equal(w2[n], w) for n, w in w1.items())
    plans = got[0]["plans"]
    assert got[1]["plans"] == plans and [p[0] for p in plans] == [16, 64, 64, 64, 64]
    n_persist = [p[3] for p in plans]
    assert n_persist[1] < n_persist[0] and got[0]["offloaded"] > 0
    for r in got:
        assert r["races"] == 0 and all(0 < peak <= bound for peak, bound in r["peaks"]), r["peaks"]
        assert r["host_group"]            # its own gloo group (the world's is used when gloo)
    assert not any(r["host_group"] for r in runs["protrain shapes, accumulation"])


def test_two_ranks_keep_the_accumulated_gradients_over_a_replan_at_degree_two(clipped_runs):
    """The sequence-parallel forward (P = 2, gather and rotate) re-plans too. The longer batch
    is the second micro-step of its optimizer step: the first one's gradients (persistent
    chunks' averaged over the ranks first, offloaded shards as they are) move into the new
    plan on both ranks, and the script's loss factor learnt by the first plan is kept.
    Sequence shards add up in another order, and offloaded chunks sum over ranks before
    micro-steps (ZeRO-3's order): DeepSpeed ZeRO-0 is matched to rounding."""
    out, runs = clipped_runs
    ref, got = runs["deepspeed shapes, accumulation"], runs["protrain shapes, accumulation"]
    assert [p[:2] for p in got[0]["plans"]] == [[16, 2]] + [[64, 2]] * 3 and got[0]["global_steps"] == 2
    for a, b in zip(ref, got):
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-5)
    w1 = torch.load(out / "deepspeed shapes, accumulation" / "weights.pt")
    w2 = torch.load(out / "protrain shapes, accumulation" / "weights.pt")
    assert all(torch.allclose(w2[n], w, atol=1e-5, rtol=1e-5) for n, w in w1.items())

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


@pytest.fixture(scope="module")
def clipped_runs(tmp_path_factory):
    """One 2-rank launch, runs in turn: plain DeepSpeed ZeRO-0 and ProTrain (CPU Adam
    speculating on every offloaded chunk, copies as late as CUDA may run them) in both
    regimes, 20 steps each; and, with gradient accumulation, ProTrain speculating against
    ProTrain whose CPU Adam waits for the end of backward."""
    clip = {"gradient_clipping": 1.0}
    runs = {}
    for regime, factor in REGIMES.items():
        spec = dict(model=MODEL, global_batch=4, steps=20, loss_factor=factor, extra=clip)
        runs[f"deepspeed {regime}"] = dict(spec, protrain=None)
        runs[f"protrain {regime}"] = dict(spec, deferred_streams=True, protrain=SPECULATING,
                                          save_16bit=True)
    gas = dict(model=MODEL, global_batch=4, steps=24, loss_factor=0.3,
               extra=dict(clip, gradient_accumulation_steps=2))
    runs["accumulation, waiting"] = dict(gas, protrain=dict(SPECULATING, speculate_chunks=0))
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

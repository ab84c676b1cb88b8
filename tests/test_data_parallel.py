"""Two ranks (gloo on CPU) train like one rank on the same global batch, and shard the host
states of offloaded chunks."""
import pytest
import torch

from dpworker import launch

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


def test_two_ranks_with_late_copies_and_speculation_equal_two_ranks_with_neither(tmp_path):
    """The all-gather / reduce-scatter on the side queues, with every copy held back until
    waited for (tests/deferred_streams.py), and CPU Adam speculating during backward under
    clipping (the norm all-reduced over both ranks) with gradient accumulation, train exactly
    as the synchronous path whose CPU Adam waits for the end of backward."""
    spec = dict(model=MODEL, global_batch=4, steps=12, loss_factor=0.3,
                extra={"gradient_clipping": 1.0, "gradient_accumulation_steps": 2},
                protrain=PLANS["offloaded chunks, swap and checkpoint"])
    (tmp_path / "sync").mkdir()
    (tmp_path / "late").mkdir()
    plan = PLANS["offloaded chunks, swap and checkpoint"]
    sync = launch(2, dict(spec, protrain=dict(plan, speculate_chunks=0)), str(tmp_path / "sync"))
    late = launch(2, dict(spec, deferred_streams=True, protrain=dict(plan, speculate_chunks=99)),
                  str(tmp_path / "late"))
    assert all(r["overlapped_chunks"] == r["rollbacks"] == 0 for r in sync)
    assert all(r["overlapped_chunks"] > 0 for r in late)
    assert late[0]["offloaded"] > 0 and all(r["most_pending_copies"] > 0 for r in late)
    # no side work read what compute wrote after the events it waits for (the reduce-scatter
    # reads the chunk buffer's padding, zeroed on the compute stream)
    assert all(r["races"] == 0 for r in late)
    for a, b in zip(sync, late):
        assert a["losses"] == b["losses"]
    w1 = torch.load(tmp_path / "sync" / "weights.pt")
    w2 = torch.load(tmp_path / "late" / "weights.pt")
    assert all(torch.equal(w2[n], w) for n, w in w1.items())

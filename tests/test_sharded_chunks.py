"""Sharded persistent chunks (protrain/runtime/chunks.py) on four gloo ranks: chunks kept on
the devices 1/4 each train as the same chunks kept whole, and as plain DeepSpeed ZeRO-0.
(Two ranks, bit for bit against DeepSpeed and with accumulation: tests/test_data_parallel.py;
the planner's choice: tests/test_search.py.)"""
import pytest
import torch

from dpworker import launch_runs

MODEL = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64, tie_embeddings=False)
# Of the 5 chunks: one whole, two more on the device (whole, or sharded over the 4 ranks),
# two offloaded; clipping around its threshold (speculation, rollbacks).
WHOLE = dict(chunk_size="230KiB", n_persist=3, n_shard=0, n_buffer=2, n_swap=1, n_checkpoint=1,
             speculate_chunks=99)
SHARDED = dict(WHOLE, n_shard=2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    spec = dict(model=MODEL, global_batch=4, steps=6, loss_factor=0.8, extra={"gradient_clipping": 1.0})
    runs = {"deepspeed": dict(spec, protrain=None),
            "whole": dict(spec, protrain=WHOLE),
            "sharded": dict(spec, deferred_streams=True, protrain=SHARDED)}
    out = tmp_path_factory.mktemp("four_ranks")
    return out, launch_runs(4, runs, str(out))


def test_four_ranks_with_sharded_persistent_chunks_train_as_whole_ones_and_as_deepspeed(four_ranks):
    out, runs = four_ranks
    whole, sharded, ds = runs["whole"], runs["sharded"], runs["deepspeed"]
    assert all(r["sharded"] == 2 and r["offloaded"] == 2 and r["races"] == 0 for r in sharded)
    assert all(r["sharded"] == 0 for r in whole)
    # The same reduce-scatter as the offloaded chunks', device Adam on a quarter: the bits of
    # the plan that keeps them whole, whose all-reduce sums in the same order here.
    for a, b in zip(whole, sharded):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
    w_whole = torch.load(out / "whole" / "weights.pt")
    w_sharded = torch.load(out / "sharded" / "weights.pt")
    assert all(torch.equal(w_sharded[n], w) for n, w in w_whole.items())
    # DeepSpeed ZeRO-0 over four gloo ranks sums its buckets in another order: to rounding.
    for a, b in zip(ds, sharded):
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-6)
    w_ds = torch.load(out / "deepspeed" / "weights.pt")
    assert all(torch.allclose(w_sharded[n], w, rtol=0, atol=1e-5) for n, w in w_ds.items())
    # Each rank holds a quarter of the two sharded chunks' states: what the memory model counts.
    assert all(r["device_state_bytes"] == r["planned_state_bytes"] for r in whole + sharded)
    assert all(r["device_state_bytes"] < whole[0]["device_state_bytes"] for r in sharded)


def test_four_ranks_fit_a_larger_model_than_one(capsys):
    """Issue 37's must-show, offline and smaller (bench/largest_model.py has the full one: with
    1 TiB of host memory one A100-80GB fits 81.8 B parameters, four 97.2 B, four keeping their
    device chunks whole 81.8 B): 30 layers of llama2-70b's shape (26 B parameters) with 256 GiB
    do not fit one A100-80GB (the host cannot take what the device does not) and fit four that
    share the chunks on their devices."""
    from protrain.cli import main
    cmd = ["plan", "--gpu", "a100-80gb", "--host-memory", "256GiB", "--layers", "30", "--hidden", "8192",
           "--heads", "64", "--kv-heads", "8", "--ffn-hidden", "28672", "--seq", "2048"]
    assert main(cmd + ["--world", "1"]) == 3
    assert "host memory too small" in capsys.readouterr().err
    assert main(cmd + ["--world", "4"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("  n_shard"))
    assert "sharded over the 4 ranks: 1/4 of their states on each device" in row, row

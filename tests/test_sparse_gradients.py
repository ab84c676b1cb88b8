"""Parameters without a gradient in a step, on one rank: ProTrain steps them on zeros exactly as
plain DeepSpeed ZeRO-0 does (its boundary all-reduce fills a missing gradient with zeros, on
one rank too), with offloaded and persistent chunks, speculating under clipping (rollbacks),
with accumulation; a mixture of experts (experts no token reaches) trains the same bits twice.
The two-rank runs are in test_data_parallel.py (one launch)."""
import pytest
import torch

import dstrain  # noqa: F401  (the one-rank distributed environment, before deepspeed starts)
from dpworker import train_run

MODEL = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64, tie_embeddings=False)
CLIP = {"gradient_clipping": 1.0}
# 64 KiB chunks: the MLP left out every other step fills chunks of its own. 22 buffers keep
# what the frozen part (embeddings, block 0: chunk 0 persistent, the rest offloaded) left in
# them cached through the step; 8 make backward prefetch it instead.
CACHED = dict(chunk_size="64KiB", n_persist=1, n_buffer=22, n_swap=0, n_checkpoint=0, speculate_chunks=0)
SPECULATING = dict(CACHED, n_buffer=8, speculate_chunks=99, host_thread=True)
BRANCH = dict(model=MODEL, global_batch=2, steps=8, kind="branch", extra=CLIP, loss_factor=0.4)
MOE = dict(model=dict(MODEL, n_layer=2), global_batch=2, steps=6, kind="moe", extra=CLIP, loss_factor=0.5)
GAS = dict(BRANCH, steps=8, extra=dict(CLIP, gradient_accumulation_steps=2))
RUNS = {
    "branch, deepspeed": dict(BRANCH, protrain=None),
    "branch, offloaded": dict(BRANCH, protrain=CACHED),
    "branch, speculating": dict(BRANCH, protrain=SPECULATING, deferred_streams=True),
    "accumulation, deepspeed": dict(GAS, protrain=None),
    "accumulation, speculating": dict(GAS, protrain=SPECULATING),
    "moe, deepspeed": dict(MOE, protrain=None),
    "moe, first": dict(MOE, protrain=SPECULATING),
    "moe, again": dict(MOE, protrain=SPECULATING),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each run in this process (one rank); {name: (result, weights)}."""
    out = tmp_path_factory.mktemp("sparse")
    done = {}
    for name, spec in RUNS.items():
        d = out / name.replace(", ", "-")
        d.mkdir()
        if spec["protrain"] is not None:       # profiled once per model
            spec = dict(spec, protrain=dict(spec["protrain"], profile_cache_dir=str(out / "profiles")))
        result, _ = train_run(0, 1, spec, str(d))
        done[name] = (result, torch.load(d / "weights.pt"))
    return done


def same(a, b) -> bool:
    return a[0]["losses"] == b[0]["losses"] and all(torch.equal(w, b[1][n]) for n, w in a[1].items())


@pytest.mark.parametrize("run", ["branch, offloaded", "branch, speculating"])
def test_a_branch_taken_every_other_step_trains_like_deepspeed_bit_for_bit(runs, run):
    assert same(runs[run], runs["branch, deepspeed"])
    got = runs[run][0]
    assert got["offloaded"] > 0
    if run == "branch, speculating":           # updates ran during backward, and some redone
        assert got["overlapped_chunks"] > 0 and got["rollbacks"] > 0


def test_with_accumulation_too(runs):
    assert same(runs["accumulation, speculating"], runs["accumulation, deepspeed"])


def test_a_mixture_of_experts_trains_the_same_bits_twice_and_like_deepspeed(runs):
    """Experts that get no token in a step (no gradient) and a router with a bias of 8 (a call
    of DeepSpeed's CPU Adam runs its last n % 16 elements in scalar code); CPU Adam on a worker
    thread, interleaving with the persistent chunks' updates by timing."""
    assert same(runs["moe, first"], runs["moe, again"])
    assert same(runs["moe, first"], runs["moe, deepspeed"])

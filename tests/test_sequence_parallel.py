"""Ulysses sequence parallelism chosen by the planner and run by the engine, for unchanged
scripts: a tiny Hugging Face Llama (from a config, MHA and GQA, labels with -100) trained on 2
and 4 gloo ranks gives the losses and gradients of a 1-rank run on the same samples, with
offloaded chunks and checkpointed, selective, swapped and SSD blocks in the plan, through an
ordinary DeepSpeed loop and through the Hugging Face Trainer; "auto" picks P=2 where P=1 does
not fit; checkpoints move between P=2 and P=1; models it cannot split are refused with the fix.

Process start-up and imports cost more than these trainings, so each launch runs several of
them one after another (tests/spworker.py) and the tests share the launches."""
import pytest

from spworker import full_grads, launch

SEQ = 32
OFFLOADED = dict(chunk_size="40KiB", n_persist=1)        # most chunks offloaded (and sharded)


def _run(name, kv, global_batch, steps, **kw):
    return dict(name=name, model=dict(kind="llama", kv_heads=kv, layers=2), seq=kw.pop("seq", SEQ),
                global_batch=global_batch, steps=steps, **kw)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sp_ckpt")


@pytest.fixture(scope="module")
def two(tmp_path_factory, ckpt_dir):
    ssd = str(tmp_path_factory.mktemp("sp_ssd"))
    runs = [
        _run("gqa", 2, 2, 2, eval=True,
             protrain=dict(OFFLOADED, sequence_parallel=2, n_checkpoint=1, n_selective=1, n_swap=0)),
        _run("mha", 4, 4, 2, gas=2, protrain=dict(OFFLOADED, sequence_parallel=2, n_swap=1,
                                                  n_checkpoint=0, n_selective=0)),
        _run("auto", 2, 2, 2, seq=128, budget_between=(1, 2), protrain=dict(accounting=True)),
        # a checkpoint saved at P=2, loaded at P=1 (data parallel), saved, loaded at P=2 again
        _run("ck1", 2, 2, 2, protrain=dict(OFFLOADED, sequence_parallel=2), save=str(ckpt_dir / "a")),
        _run("ck2", 2, 2, 1, start=2, protrain=dict(OFFLOADED, sequence_parallel=1),
             load=str(ckpt_dir / "a"), save=str(ckpt_dir / "b")),
        _run("ck3", 2, 2, 1, start=3, protrain=dict(OFFLOADED, sequence_parallel=2), load=str(ckpt_dir / "b")),
        # a block's saved tensors on the SSD tier, the same samples as "gqa"
        _run("ssd", 2, 2, 2, protrain=dict(OFFLOADED, sequence_parallel=2, n_ssd=1, n_checkpoint=0,
                                           n_swap=0, n_selective=0, ssd_path=ssd, ssd_min_bytes=0)),
        # the head and loss over tiles (tests/test_tiled_head.py), the MLPs over tiles of 4 of
        # each rank's 16 tokens (tests/test_tiled_mlp_plans.py) in a host-input and a selective
        # block, the checkpointed block's input in host memory (tests/test_ckpt_input.py), the
        # same samples as "gqa"
        _run("tiled", 2, 2, 2, protrain=dict(OFFLOADED, sequence_parallel=2, n_checkpoint=1, n_selective=1,
                                             n_swap=0, head_tile=8, mlp_tile=4, ckpt_input="host")),
        # the Hugging Face Trainer with the "protrain" key in its DeepSpeed JSON
        _run("trainer", 2, 4, 3, trainer=True,
             protrain=dict(OFFLOADED, sequence_parallel=2, n_checkpoint=1, n_swap=0, n_selective=0)),
        # refused, saying what to do: attention that is not SDPA, a loss computed outside forward
        # (rank 0 fails while profiling: its peer must not wait for the plan for ever)
        dict(_run("eager", 2, 2, 1, protrain=dict(sequence_parallel=2), expect_error=True),
             model=dict(kind="llama", kv_heads=2, layers=2, attn="eager")),
        _run("outside", 2, 2, 1, loss_outside=True, protrain=dict(sequence_parallel=2), expect_error=True),
        dict(name="exchange", exchange=True),
    ]
    return launch(2, runs, str(tmp_path_factory.mktemp("sp_two")))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    runs = [_run("p4", 2, 4, 2, protrain=dict(OFFLOADED, sequence_parallel=4, n_checkpoint=1,
                                              n_swap=0, n_selective=0)),
            _run("p2dp2", 2, 4, 2, protrain=dict(OFFLOADED, sequence_parallel=2, n_selective=2))]
    return launch(4, runs, str(tmp_path_factory.mktemp("sp_four")))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """One rank, the same samples: a rank's share of the global batch becomes that many
    micro-batches of gradient accumulation (DeepSpeed averages them, as data parallel does)."""
    runs = [_run("gqa", 2, 2, 2, gas=2, eval=True, protrain={}),
            _run("mha", 4, 4, 2, gas=4, protrain={}),
            _run("auto", 2, 2, 2, gas=2, seq=128, protrain={}),
            _run("ck", 2, 2, 4, gas=2, protrain={}),
            _run("four", 2, 4, 2, gas=4, protrain={}),
            # the Trainer's loss: summed over the whole global batch, over its valid targets
            _run("trainer", 2, 4, 3, num_items=True, protrain={})]
    return launch(1, runs, str(tmp_path_factory.mktemp("sp_ref")))


def _same_training(runs, reference, gas=1, grad_rel=1e-5):
    """Per-micro-batch losses and per-step gradients of a multi-rank run equal the reference's
    (gradients to ``grad_rel`` of each tensor's largest element)."""
    world = len(runs)
    steps = len(runs[0]["losses"]) // gas
    got = [runs[r]["losses"][s * gas + m] for s in range(steps) for r in range(world) for m in range(gas)]
    assert got == pytest.approx(reference[0]["losses"], rel=1e-5)
    g_run, g_ref = full_grads(runs), full_grads(reference)
    assert len(g_run) == len(g_ref) == steps
    for step, (a, b) in enumerate(zip(g_run, g_ref)):
        assert a.keys() == b.keys()
        for name in b:
            err = (a[name] - b[name]).abs().max() / b[name].abs().max()
            assert err <= grad_rel, (step, name, float(err))


@pytest.mark.parametrize("case", ["gqa", "mha", "ssd", "tiled"])
def test_two_ranks_train_like_one_rank_on_the_same_samples(two, ref, case):
    runs = two[case]
    assert all(r["sp"] == 2 for r in runs)
    assert runs[0]["offloaded"] > 0
    assert runs[0]["modes"] == {"gqa": "CA", "mha": "SN", "ssd": "DN", "tiled": "HA"}[case]
    if case == "tiled":       # each rank's 16 tokens in tiles of 8, the mean over the group's count
        assert all(r["head_tile"] == 8 and r["tiled_forwards"] == 4 for r in runs), runs[0]["tiled_forwards"]
        assert all(r["mlp_tile"] == 4 for r in runs)
    # Tiled MLPs sum their weight gradients over the tiles (4 per rank here), in another order
    # than one product over the tokens: to rounding, which cancellation in a gradient's sum
    # magnifies against its largest element (measured 2e-5).
    _same_training(runs, ref["gqa" if case in ("ssd", "tiled") else case], gas=2 if case == "mha" else 1,
                   grad_rel=1e-4 if case == "tiled" else 1e-5)
    if case == "gqa":        # evaluation forwards (no_grad, eval mode) give each rank its loss
        got = [r["eval"] for r in runs]
        assert [x for g in got for x in g] == pytest.approx(ref[case][0]["eval"], rel=1e-5)
        # and so does the model called directly, outside the engine (plain attention there:
        # the Ulysses wrappers mixed the ranks' samples before)
        got = [r["outside"] for r in runs]
        assert [x for g in got for x in g] == pytest.approx(ref[case][0]["eval"], rel=1e-5)


def test_the_hot_path_waits_for_the_device_once_per_step(two):
    """Per engine call the group compares digests of its batches' layouts (gathered as objects
    only at the first call); the host reads device data once per optimizer step for the
    runtime's verdict (clipping at DeepSpeed's default 1.0) and once for sequence
    parallelism's checks (the factor each micro-step's loss got, learnt with one read at the
    plan's first micro-step) - not once per micro-step's backward."""
    for case, steps, gas in (("gqa", 2, 1), ("mha", 2, 2)):
        for r in two[case]:
            waits = r["host_waits"]
            assert waits["all_gather_object"] == 1, (case, waits)
            assert waits["to_host"] == 2 * steps + (gas > 1), (case, waits)


def test_batches_are_exchanged_as_bytes_and_their_layouts_only_when_one_changed(two):
    for r in two["exchange"]:
        assert r["right"] == [True] * 4
        assert r["exchanges"] == [1, 1, 2, 3]      # the first call, rank 1's change, back


def test_auto_picks_the_degree_that_fits_and_says_why(two, ref):
    runs = two["auto"]
    r = runs[0]
    assert r["sp"] == 2, r["notes"]
    assert any(n.startswith("P=1 does not fit: needs") for n in r["notes"]), r["notes"]
    assert "P=1 does not fit" in r["explain"] and "sequence_parallel  2" in r["explain"]
    for rank in runs:                        # the runtime's own count is what the plan said
        assert rank["activation_peak"] == pytest.approx(rank["predicted_activation_peak"], rel=0.002)
        assert rank["peak"] * 1.1 <= rank["budget"]
    _same_training(runs, ref["auto"])


def test_checkpoints_move_between_p2_and_p1(two, ref):
    assert [two[n][0]["sp"] for n in ("ck1", "ck2", "ck3")] == [2, 1, 2]
    world = 2
    got = [two[n][r]["losses"][i] for n in ("ck1", "ck2", "ck3")
           for i in range(len(two[n][0]["losses"])) for r in range(world)]
    assert got == pytest.approx(ref["ck"][0]["losses"], rel=1e-5)


def test_four_ranks_p4_and_p2_times_data_parallel(four, ref):
    assert [r["sp"] for r in four["p4"]] == [4] * 4 and four["p4"][0]["modes"] == "CN"
    assert [r["sp"] for r in four["p2dp2"]] == [2] * 4 and four["p2dp2"][0]["modes"] == "AA"
    _same_training(four["p4"], ref["four"])
    _same_training(four["p2dp2"], ref["four"])


def test_models_the_runtime_cannot_split_are_refused_with_the_fix(two):
    for r in two["eager"]:     # attention not through SDPA: load the model with sdpa, or P=1
        assert "attn_implementation=\"sdpa\"" in r["error"] and "sequence_parallel" in r["error"], r
    # A loss computed outside forward: the profile (rank 0) needs it from forward, says so, and
    # the other rank, waiting for the plan, stops too instead of hanging.
    outside = [r["error"] for r in two["outside"]]
    assert "return the loss or a Hugging Face ModelOutput with .loss from forward" in outside[0]
    assert outside[1].startswith("RuntimeError: ProTrain: rank 0 failed while profiling and planning "
                                 "(TypeError: cannot find a loss"), outside[1]


def test_hugging_face_trainer_with_sequence_parallelism(two, ref):
    runs = two["trainer"]
    assert all(r["engine"] == "ProTrainEngine" and r["sp"] == 2 for r in runs)
    assert runs[0]["modes"] == "CN" and runs[0]["offloaded"] > 0
    reference = ref["trainer"]
    # The Trainer logs the loss of the whole global batch (averaged over ranks) and scales the
    # loss by the world size before backward: the engine learnt that factor at the first step.
    assert runs[0]["losses"] == runs[1]["losses"]
    assert runs[0]["losses"] == pytest.approx(reference[0]["losses"], rel=1e-5)
    g_run, g_ref = full_grads(runs), full_grads(reference)
    assert len(g_run) == len(g_ref) == 3
    for a, b in zip(g_run, g_ref):
        for name in b:
            assert float((a[name] - b[name]).abs().max() / b[name].abs().max()) <= 1e-5, name


def test_checks_taken_on_the_device_are_read_together_at_the_step():
    """After the plan's first micro-step, the factor each returned loss got and the verdict
    on each attention mask stay on the device until the optimizer step reads them, all in one
    host read; a padding mask or a changed factor is refused there, before the step applies
    anything. Without a step to wait for (evaluation), a mask is read at once."""
    from types import SimpleNamespace

    import torch

    from protrain.runtime.streams import Streams
    from protrain.sp.batch import shard
    from protrain.sp.ulysses import SequenceParallelError
    from protrain_ds.sequence_parallel import SequenceParallelForward
    reads = []

    class Counting(Streams):
        def to_host(self, t):
            reads.append(t.numel())
            return super().to_host(t)
    runtime = SimpleNamespace(streams=Counting(torch.device("cpu")),
                              optimizer=SimpleNamespace(first_step_of_plan=False))
    sp = SequenceParallelForward.__new__(SequenceParallelForward)
    sp.engine, sp._pending, sp.factor = SimpleNamespace(protrain_runtime=runtime), [], None
    sp._received(torch.tensor(0.5), 0.5, 1.0)        # the plan's first micro-step: learnt now
    assert reads == [1] and sp.factor == 0.5
    ids = torch.zeros(2, 4, dtype=torch.long)
    for _ in range(3):
        sp._received(torch.tensor(0.5), 0.5, 1.0)
        shard((), {"input_ids": ids, "attention_mask": torch.ones(2, 4)}, rank=0, degree=2,
              shift_labels=False, position_ids=False, check_mask=sp._mask_later)
    assert reads == [1]
    sp.verify()
    assert reads == [1, 6]                           # three factors and three masks, one read
    padded = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    shard((), {"input_ids": ids, "attention_mask": padded}, rank=0, degree=2, shift_labels=False,
          position_ids=False, check_mask=sp._mask_later)
    with pytest.raises(SequenceParallelError, match="padding attention_mask"):
        sp.verify()
    sp._received(torch.tensor(0.25), 0.5, 1.0)
    with pytest.raises(SequenceParallelError, match="scaled by 0.25"):
        sp.verify()
    with pytest.raises(SequenceParallelError, match="padding attention_mask"):
        shard((), {"input_ids": ids, "attention_mask": padded}, rank=0, degree=2, shift_labels=False,
              position_ids=False)

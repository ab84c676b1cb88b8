"""Never silently wrong (issue 32): generated model structures - shared and repeated blocks,
blocks returning tuples, dicts and ModelOutputs, buffers updated in forward, parameters frozen
and unfrozen mid-run, an evaluation before training, inputs without a sequence dimension on
two ranks - trained by plain DeepSpeed ZeRO-0 and by ProTrain (forced through offloaded chunks
with a checkpointed and a swapped block and speculative CPU Adam under clipping, and under the
planner's own plan). Each ProTrain run ends with DeepSpeed's losses, weights and buffers bit for
bit, or is refused by name (a ConfigError, or an error saying what ProTrain cannot run and what
to do) - never trained differently, never an internal error (tests/structures.py)."""
import pytest
import torch

import dstrain  # noqa: F401 - one-rank distributed environment
import structures

BASE = dict(input="tokens", depth=3, blocks="distinct", calls=1, output="tensor", buffers=False,
            schedule=None, eval_first=False, layerdrop=False)


def shape(**over) -> dict:
    return dict(BASE, **over)


# One feature at a time off the plain shape, then some together.
CASES = {
    "plain": shape(),
    "shared": shape(blocks="shared"),
    "alternating": shape(blocks="alternating", depth=4),
    "called twice": shape(calls=2),
    "tuple": shape(output="tuple"),
    "in place": shape(output="inplace"),
    "LayerDrop": shape(layerdrop=True, depth=4),
    "tuple, hidden second": shape(output="tuple_second"),
    "dict": shape(output="dict"),
    "ModelOutput": shape(output="model_output"),
    "buffers": shape(buffers=True),
    "unfrozen later": shape(schedule="unfreeze"),
    "frozen later": shape(schedule="freeze"),
    "evaluation first": shape(eval_first=True, buffers=True),
    "features": shape(input="features"),
    "shared, dict, buffers": shape(blocks="shared", output="dict", buffers=True),
    "alternating twice, unfrozen, evaluation first": shape(blocks="alternating", depth=4, calls=2,
                                                          schedule="unfreeze", eval_first=True),
}

REFUSED: dict[str, str] = {}
"""Cases ProTrain refuses, by name, with a phrase its message must hold (none today)."""


@pytest.fixture(scope="module")
def reference():
    return {name: structures.train(s, None) for name, s in CASES.items()}


def check(got: dict, ref: dict, name: str) -> None:
    if "error" in got:
        assert name in REFUSED, f"{name}: refused, not trained: {got['error']}"
        assert got["error"].startswith("ConfigError") or "ProTrain" in got["error"], got["error"]
        assert REFUSED[name] in got["error"], got["error"]
        return
    assert name not in REFUSED, f"{name}: trained, though expected refused"
    assert got["losses"] == ref["losses"], name
    assert got.get("eval") == ref.get("eval"), name
    for kind in ("weights", "buffers"):
        assert got[kind].keys() == ref[kind].keys(), (name, kind)
        for n, t in ref[kind].items():
            assert torch.equal(got[kind][n], t), (name, kind, n, float((got[kind][n].float() - t.float()).abs().max()))


@pytest.mark.parametrize("section", ["forced", "planner"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_structure_trains_like_deepspeed_or_is_refused_by_name(reference, name, section):
    got = structures.train(CASES[name], "forced" if section == "forced" else {})
    check(got, reference[name], name)


def test_two_ranks_without_a_sequence_dimension(tmp_path):
    """Inputs (batch, features) on two ranks: no dimension is a sequence to profile at half
    length or split (the second profile cut dimension 1 before)."""
    s = shape(input="features", buffers=True)
    runs = {"ds": (s, None), "forced": (s, "forced"), "planner": (s, {})}
    ranks = structures.launch(2, runs, str(tmp_path))
    for r in ranks:
        for name in ("forced", "planner"):
            check(r[name], r["ds"], "features on two ranks")


def test_a_checkpointed_block_that_changes_its_input_in_place_is_refused_by_name():
    """The planner checkpoints no block of a model it saw change an input in place (the
    differential case "in place"); a plan made without that knowledge (a plan file, a cached
    profile) is refused at the forward, not trained from a recompute of the changed input."""
    from protrain.block_mode import BlockMode
    from protrain.runtime.activations import checkpointed_blocks
    block = structures.Block("inplace", False)
    x = torch.randn(2, structures.SEQ, structures.HIDDEN, requires_grad=True) * 1.0
    with checkpointed_blocks([block], [BlockMode.CKPT]):
        with pytest.raises(RuntimeError, match="Block changed an input in place in forward"):
            block(x)

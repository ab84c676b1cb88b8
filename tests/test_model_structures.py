"""Models that are not transformers train with the section injected exactly as plain DeepSpeed
ZeRO-0 trains them (fp32 losses and final weights and buffers, bit for bit), or are refused
by name: DeepSpeed's unit-test SimpleModel, an MLP on (batch, features) and CNNs on
(batch, channels, H, W) on one and two gloo ranks, a model whose block list the section
names (tests/structure_models.py holds the models and the training loop)."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import dstrain  # noqa: E402,F401  (the distributed environment for one process)
from structure_models import batch, train  # noqa: E402

from protrain.batch_shape import BatchShape, batch_dims  # noqa: E402
from protrain.config import ConfigError  # noqa: E402
from protrain.runtime.boundaries import BlockOrderError  # noqa: E402

_DEEPSPEED: dict = {}


def deepspeed_run(kind: str, sizes=None) -> dict:
    """Plain DeepSpeed ZeRO-0's run of ``kind`` (once per kind and batch sizes)."""
    key = (kind, tuple(sizes or ()))
    if key not in _DEEPSPEED:
        _DEEPSPEED[key] = train(kind, None, sizes=sizes)
    return _DEEPSPEED[key]


def assert_same(got: dict, want: dict) -> None:
    assert len(want["losses"]) >= 4 and got["losses"] == want["losses"]
    assert got["weights"].keys() == want["weights"].keys()
    for n, w in want["weights"].items():
        assert torch.equal(got["weights"][n], w), n
    for n, b in want["buffers"].items():
        assert torch.equal(got["buffers"][n], b), n


# What each model is planned as, with offloaded chunks (n_persist below the chunks) and
# blocks swapped and recomputed where the model has enough of them.
SIMPLE = dict(chunk_size="4KiB", n_persist=1)


@pytest.mark.parametrize("kind, section, blocks, modes", [
    # a ModuleList of one Linear: no list of repeated blocks; its top-level module is the block
    ("simple", dict(SIMPLE, n_swap=1), ["linears.0"], "S"),
    # an unused layer (no gradient: stepped on zeros, as DeepSpeed does), a block that never runs
    ("simple_empty_grad", dict(SIMPLE, n_checkpoint=1, n_swap=0), ["linears.0", "linear2"], "CN"),
    # layer i // 2 runs again at step i, right after itself (0 0 0 1 1 2): each block's part
    # spans its calls, one swapped and one recomputed
    ("simple_3_layers", dict(SIMPLE, n_swap=1, n_checkpoint=1), ["linears.0", "linears.1", "linears.2"],
     "SCN"),
])
def test_deepspeeds_simple_model_trains_like_deepspeed_zero0(kind, section, blocks, modes):
    got = train(kind, section)
    assert (got["blocks"], got["modes"]) == (blocks, modes)
    assert got["offloaded"] >= 1
    assert_same(got, deepspeed_run(kind))


def test_albert_with_its_one_shared_layer_group_trains_like_deepspeed_zero0():
    pytest.importorskip("transformers")
    got = train("albert", dict(chunk_size="8KiB", n_persist=1, n_checkpoint=1, n_swap=0))
    assert got["blocks"] == ["model.albert", "model.predictions"] and got["modes"] == "CN"
    assert got["offloaded"] >= 1 and got["seq_len"] == 16
    assert_same(got, deepspeed_run("albert"))


@pytest.mark.parametrize("section, modes", [
    # the pooling between conv1/bn and conv2 runs in conv2's part: it is swapped with it
    (dict(chunk_size="12KiB", n_persist=1, n_swap=3, n_checkpoint=1), "SSSC"),
    # BatchNorm recomputed: its running statistics are updated once per step, not twice
    (dict(chunk_size="12KiB", n_persist=1, n_checkpoint=4), "CCCC"),
])
def test_a_cnn_with_batchnorm_trains_like_deepspeed_zero0(section, modes):
    got = train("cnn", section)
    assert (got["blocks"], got["modes"]) == (["conv1", "bn", "conv2", "fc"], modes)
    assert got["offloaded"] >= 1 and got["seq_len"] is None
    assert got["buffers"]["bn.num_batches_tracked"] == 4       # profiling's forwards undone
    assert_same(got, deepspeed_run("cnn"))


def test_modules_declared_out_of_call_order_are_planned_in_call_order():
    got = train("reversed_cnn", dict(chunk_size="12KiB", n_persist=1, n_swap=1, n_checkpoint=1))
    assert got["blocks"] == ["conv1", "conv2", "fc"] and got["offloaded"] >= 1
    assert_same(got, deepspeed_run("reversed_cnn"))


def test_an_mlp_replans_for_more_samples_and_trains_like_deepspeed_zero0():
    sizes = [2, 2, 4, 2]
    got = train("mlp", dict(chunk_size="4KiB", n_persist=2, n_swap=1, n_checkpoint=1), sizes=sizes)
    assert got["blocks"] == [f"layers.{i}" for i in range(4)] and got["offloaded"] >= 1
    assert (got["micro_batch"], got["seq_len"]) == (4, None)
    assert_same(got, deepspeed_run("mlp", sizes))


def test_a_block_list_named_in_the_section_is_planned():
    got = train("encoder", dict(blocks="encoder.layer", chunk_size="8KiB", n_persist=1,
                                n_swap=1, n_checkpoint=2))
    assert got["blocks"] == [f"encoder.layer.{i}" for i in range(4)] and got["offloaded"] >= 1
    assert_same(got, deepspeed_run("encoder"))


@pytest.mark.parametrize("path, says", [
    ("encoder.layers", "names no module"),
    ("head", "is a Linear, not a ModuleList"),
    ("encoder", "is a Module, not a ModuleList"),
])
def test_a_blocks_key_that_names_no_list_is_refused_naming_the_key(path, says):
    with pytest.raises(ConfigError) as e:
        train("encoder", {"blocks": path})
    msg = str(e.value)
    assert f"protrain.blocks = {path!r} {says}" in msg
    assert "'encoder.layer' (4 x Residual/Gated)" in msg and "'aux' (2 x Linear)" in msg
    with pytest.raises(ConfigError, match="protrain.blocks = 7: must be a module name"):
        train("encoder", {"blocks": 7})


def test_a_named_list_whose_blocks_run_again_right_after_themselves_is_planned():
    got = train("simple_3_layers", {"blocks": "linears", **SIMPLE})
    assert got["blocks"] == ["linears.0", "linears.1", "linears.2"]
    assert_same(got, deepspeed_run("simple_3_layers"))


def test_blocks_that_change_their_order_after_planning_are_refused(monkeypatch):
    """The runtime checks every iteration's order: chunks of parts left behind are released
    and gradients of later parts declared done as it goes."""
    import structure_models
    forward = structure_models.Encoder.forward
    calls = []

    def swapped_later(self, x, y):
        calls.append(1)
        if len(calls) > 6:          # after the profile's forwards and the first step
            self.encoder.layer[0], self.encoder.layer[1] = self.encoder.layer[1], self.encoder.layer[0]
        return forward(self, x, y)
    monkeypatch.setattr(structure_models.Encoder, "forward", swapped_later)
    said = r"block encoder.layer.0 \(position 0 of the 4 blocks\) was called after block encoder.layer.1"
    with pytest.raises(BlockOrderError, match=said):
        train("encoder", {"blocks": "encoder.layer", "chunk_size": "8KiB", "n_persist": 1})


@pytest.mark.parametrize("key, says", [
    ("max_seq_len", "protrain.max_seq_len = 64: the first batch has no sequence dimension"),
    ("profile_seq_len", "protrain.profile_seq_len = 64: the first batch has no [batch, sequence] tensor"),
])
def test_sequence_lengths_are_refused_for_a_batch_without_a_sequence(key, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        train("cnn", {key: 64})


def test_batch_dims_find_a_sequence_only_where_the_inputs_have_one():
    ids = torch.zeros(2, 7, dtype=torch.long)
    assert batch_dims((ids, ids), {}) == (2, 7)                              # the built-in GPT
    assert batch_dims((), {"input_ids": ids, "labels": ids}) == (2, 7)
    assert batch_dims((), {"inputs_embeds": torch.zeros(2, 5, 8)}) == (2, 5)
    assert batch_dims(batch("mlp", 0, 3), {}) == (3, None)                   # features
    assert batch_dims(batch("cnn", 0, 3), {}) == (3, None)                   # images
    assert batch_dims((), {}) == (None, None)
    plan = BatchShape(4, None)
    assert plan.covers(BatchShape(3, None)) and not plan.covers(BatchShape(5, None))
    assert plan.union(BatchShape(6, None)) == BatchShape(6, None) and str(plan) == "4 samples"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch of two gloo ranks: an MLP and a CNN under plain DeepSpeed ZeRO-0 and with
    offloaded chunks (every rank takes its half of each global batch)."""
    from ranks import start_ranks
    from dpworker import free_port
    from structure_models import run_rank
    runs = {"mlp, deepspeed": ("mlp", None),
            "mlp": ("mlp", dict(chunk_size="4KiB", n_persist=1, n_checkpoint=1, n_swap=1)),
            "cnn, deepspeed": ("cnn", None),
            "cnn": ("cnn", dict(chunk_size="12KiB", n_persist=1, n_checkpoint=1, n_swap=1))}
    out = tmp_path_factory.mktemp("structures")
    start_ranks(run_rank, (2, free_port(), runs, str(out)), 2)
    return {name: torch.load(out / f"{name}.pt") for name in runs}


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_two_ranks_train_features_and_images_like_deepspeed_zero0(kind, two_ranks):
    got = two_ranks[kind]
    assert got["offloaded"] >= 1 and got["seq_len"] is None
    assert any(n.startswith("sequence parallelism off: the batch has no sequence dimension")
               for n in got["notes"])
    assert_same(got, two_ranks[f"{kind}, deepspeed"])

"""Memory cost model: each term against hand-computed cases."""
from dataclasses import replace

import numpy as np

from protrain.block_mode import CKPT, NONE, SWAP, BlockMode
from protrain.layout import build_layout
from protrain.cost.memory import (activation_walk, buffer_numel, model_state_device_bytes,
                                  model_state_host_bytes, norm_scratch_bytes, predict_memory,
                                  state_bytes, swap_host_bytes)
from protrain.profile.model_profile import ModelProfile, ParamRecord

from conftest import chain_profile, part


def walk_profile():
    """Keep-all levels chosen by hand (bytes)."""
    parts = (
        part("<pre>", "pre", numel=10, fs=0, fp=5, bs=10, bp=12),
        part("b0", "block", numel=10, inb=5, saved=20, fs=5, fp=30, bs=30, bp=40),
        part("b1", "block", numel=10, inb=5, saved=20, fs=25, fp=60, bs=50, bp=60),
        part("<post>", "post", numel=0, inb=5, saved=10, fs=45, fp=60, bs=65, bp=70),
    )
    params = tuple(ParamRecord(f"p{i}", 10, (i,)) for i in range(3))
    return ModelProfile("walk", "measured", "cpu", 2, params, parts)


def walk(modes):
    """(peak, walk index) with index = 2 * part + (0 forward, 1 backward)."""
    act, where = activation_walk(walk_profile(), np.array([modes]))
    return int(act[0]), int(where[0])


def test_keep_all_peak_is_the_profiled_peak():
    assert walk([NONE, NONE]) == (70, 7)  # backward of <post>


def test_checkpoint_frees_saved_minus_input():
    # X = 20 - 5 = 15 for the parts after b0: post's backward 70 - 15 = 55 is the new peak;
    # b0's own backward: max(recompute 30 - 20 + 5 + (30 - 5), 40) = 40.
    assert walk([CKPT, NONE]) == (55, 7)


def test_checkpoint_input_chain_and_recompute_bump():
    # Both checkpointed: post's backward drops to 70 - 30 = 40, and b1's recompute bump,
    # 50 - 15 - 20 + 5 + (60 - 25) = 55, is the peak (backward of b1).
    assert walk([CKPT, CKPT]) == (55, 5)


def test_swap_frees_everything_saved_but_one_block_is_in_flight():
    # b0 swapped: X = 20 after it, but while b1 runs forward b0's copy is in flight (+20):
    # fwd b1 = 60 - 20 + 20 = 60, and b0's prefetch during b1's backward: 60 - 20 + 20 = 60;
    # post's backward 70 - 20 = 50.
    assert walk([SWAP, NONE]) == (60, 4)
    assert walk([SWAP, SWAP]) == (60, 4)


def test_swap_host_bytes():
    assert int(swap_host_bytes(walk_profile(), np.array([[SWAP, SWAP]]))[0]) == 40
    assert int(swap_host_bytes(walk_profile(), np.array([[SWAP, CKPT]]))[0]) == 20


def test_state_bytes_per_element():
    # bf16: param 2 + fp32 grad 4 + fp32 master 4 + Adam m, v 8 on the device; on the host
    # master + m + v 12 and one bf16 region shared by the upload copy and the gradients...
    assert state_bytes(2) == state_bytes(2, False)
    assert (state_bytes(2).persistent, state_bytes(2).buffer, state_bytes(2).host) == (18, 2, 14)
    # ...unless micro-batches accumulate: then an fp32 accumulator of its own.
    assert state_bytes(2, grad_accumulation=True).host == 18
    # fp32: param 4 (is the master) + grad 4 + m, v 8; host: master (upload source), m, v and
    # a 4-byte gradient landing / accumulation region.
    assert (state_bytes(4).persistent, state_bytes(4).buffer, state_bytes(4).host) == (16, 4, 16)
    assert state_bytes(4, grad_accumulation=True).host == 16


def test_model_state_bytes_from_the_layout():
    prof = chain_profile(block_params=(100, 60), pre_params=30, param_bytes=2)
    layout = build_layout(prof, 100)           # chunks: [30], [100], [60]
    assert layout.used == (30, 100, 60) and layout.chunk_bytes == 200
    sb = state_bytes(2)
    # 2 persistent chunks (130 elements x 18) + 1 buffer of 100 elements x 2 bytes
    assert int(model_state_device_bytes(layout, 2, 1, sb)) == 130 * 18 + 200
    assert int(model_state_host_bytes(layout, 2, sb)) == 60 * 14
    assert int(model_state_host_bytes(layout, 0, sb)) == 190 * 14
    assert int(model_state_host_bytes(layout, 0, state_bytes(2, True))) == 190 * 18


def test_predict_memory_adds_states_and_walk_and_names_the_peak():
    prof = walk_profile()
    layout = build_layout(prof, 10)
    m = predict_memory(prof, layout, 1, 2, (BlockMode.CKPT, BlockMode.NONE))
    assert m.model_state_bytes == 10 * 18 + 2 * 20
    assert m.activation_peak_bytes == 55
    assert m.peak_device_bytes == 10 * 18 + 40 + 55
    assert m.peak_at == "backward of <post>"
    assert m.host_bytes == 20 * 14


def test_the_clipping_norm_copies_the_largest_offloaded_16_bit_gradient_to_fp32():
    """DeepSpeed's per-parameter norm, g.float().norm(2), on the device as each offloaded
    chunk's gradients leave: 4 bytes per element of the largest parameter offloaded."""
    prof = chain_profile(block_params=(100, 60), pre_params=30, param_bytes=2)
    layout = build_layout(prof, 100)           # chunks: [30], [100], [60]
    got = norm_scratch_bytes(prof, layout, clipping=True, grad_accumulation=False)
    assert got.tolist() == [400, 400, 240, 0]   # per n_persist 0..3
    m = predict_memory(prof, layout, 2, 1, (BlockMode.NONE, BlockMode.NONE), norm_scratch=int(got[2]))
    assert m.norm_scratch_bytes == 240
    assert m.peak_device_bytes == m.model_state_bytes + m.activation_peak_bytes + 240
    # none without clipping, with accumulation (the norms are taken on the host), or in fp32
    # (float() returns the gradient itself)
    assert not norm_scratch_bytes(prof, layout, clipping=False, grad_accumulation=False).any()
    assert not norm_scratch_bytes(prof, layout, clipping=True, grad_accumulation=True).any()
    fp32 = chain_profile(block_params=(100, 60), pre_params=30, param_bytes=4)
    assert not norm_scratch_bytes(fp32, build_layout(fp32, 100), True, False).any()


def test_sharded_host_bytes_and_padded_buffers():
    prof = chain_profile(block_params=(100, 61), pre_params=30, param_bytes=2)
    layout = build_layout(prof, 100)           # chunks: [30], [100], [61]
    sb = state_bytes(2)
    # 2 ranks keep ceil(100 / 2) + ceil(61 / 2) = 81 elements of the offloaded chunks each
    assert int(model_state_host_bytes(layout, 1, sb, world=2)) == (50 + 31) * 14
    assert buffer_numel(layout, 3) == 102       # 100 padded to a multiple of 3
    assert int(model_state_device_bytes(layout, 1, 2, sb, world=3)) == 30 * 18 + 2 * 102 * 2


def relu_tail_profile():
    """Hand numbers for blocks whose output (5 bytes) is saved by the block (a ReLU) and by the
    next block: each block owns 15 internal + 5 output bytes; b1 re-saves its input."""
    parts = (
        part("<pre>", "pre", numel=10, fs=0, fp=5, bs=5, bp=7),
        replace(part("b0", "block", numel=10, inb=5, saved=25, fs=5, fp=30, bs=35, bp=45), kept_bytes=5),
        replace(part("b1", "block", numel=10, inb=5, saved=20, fs=30, fp=55, bs=55, bp=58),
                kept_bytes=5, resaved_bytes=5, in_shared_bytes=5),
        part("<post>", "post", numel=0, inb=5, saved=10, fs=50, fp=65, bs=60, bp=70),
    )
    params = tuple(ParamRecord(f"p{i}", 10, (i,)) for i in range(3))
    return ModelProfile("relu", "measured", "cpu", 2, params, parts)


def relu_walk(modes):
    act, where = activation_walk(relu_tail_profile(), np.array([modes]))
    return int(act[0]), int(where[0])


def test_a_checkpointed_block_cannot_free_what_the_next_block_saved():
    # b0 CKPT frees its 15 internal bytes (25 saved - 5 kept output - 5 held input), not
    # 25 - 5 = 20: post's backward 70 - 15 = 55.
    assert relu_walk([CKPT, NONE]) == (55, 7)
    # b1 CKPT: its input is b0's output (shared, live anyway): it frees 20 - 5 kept = 15, and
    # its recompute bump, 55 - (20 - 0) + (55 - 30) = 60, is the peak (not 58 - 0).
    assert relu_walk([NONE, CKPT]) == (60, 5)


def test_adjacent_offloaded_blocks_free_and_copy_the_shared_storage():
    # b0 SWAP alone frees 20, not its kept output; b1's backward with b0 prefetched:
    # 58 - 20 + 20.
    assert relu_walk([SWAP, NONE]) == (58, 5)
    # Both swapped: b0 lets its output go too (b1 offloads it as well): X = 25 before b1;
    # b1's backward: 58 - 25 + 25 (b0 prefetched) + 5 (b1's own copy of the shared input).
    assert relu_walk([SWAP, SWAP]) == (63, 5)
    # Host bytes count b1's copy of its re-saved input.
    assert int(swap_host_bytes(relu_tail_profile(), np.array([[SWAP, SWAP]]))[0]) == 25 + 25

"""Chunk layout: execution-order packing, tied parameters, buffer minimums."""
import pytest

from protrain.layout import build_layout, chunk_capacities
from protrain.profile.model_profile import ModelProfile, ParamRecord

from conftest import chain_profile, part


def test_packs_in_execution_order_without_splitting():
    prof = chain_profile(block_params=(60, 60, 60), pre_params=30)
    layout = build_layout(prof, 100)
    # 30 + 60 > 100? no: 90 fits; next 60 starts chunk 1; ...
    assert layout.used == (90, 60, 60)
    assert layout.param_chunk == (0, 0, 1, 2)
    assert layout.part_chunks[:4] == ((0,), (0,), (1,), (2,))
    assert layout.chunk_first_part == (0, 2, 3) and layout.chunk_last_part == (1, 2, 3)
    assert layout.min_persist == 0


def test_tied_parameter_forces_its_chunk_persistent():
    prof = chain_profile(block_params=(100, 100), pre_params=100, tied=True)
    layout = build_layout(prof, 100)
    assert layout.part_chunks[-1] == (0,)      # the head uses the embedding's chunk
    assert layout.min_persist == 1


def test_compute_share_follows_elements_used_per_chunk():
    params = (ParamRecord("a", 50, (0,)), ParamRecord("b", 80, (1,)), ParamRecord("c", 20, (1,)))
    parts = (part("<pre>", "pre"), part("b0", "block"), part("<post>", "post"))
    prof = ModelProfile("x", "measured", "cpu", 4, params, parts)
    layout = build_layout(prof, 100)           # [a], [b, c]? 50+80 > 100 -> [a], [b, c]
    assert layout.used == (50, 100)
    assert layout.part_chunks[1] == (1,) and layout.part_chunk_share[1] == (1.0,)
    layout = build_layout(prof, 130)           # [a, b], [c]
    assert layout.part_chunks[1] == (0, 1)
    assert layout.part_chunk_share[1] == pytest.approx((0.8, 0.2))


def test_min_buffers_is_the_widest_chunk_range_of_a_part():
    prof = chain_profile(block_params=(250, 100), pre_params=10)
    layout = build_layout(prof, 250)           # [10], [250], [100]
    assert layout.min_buffers(0) == 1
    prof = chain_profile(block_params=(100, 100), pre_params=10)
    layout = build_layout(prof, 105)           # [10], [100], [100]: one chunk per part
    assert [layout.min_buffers(n) for n in range(4)] == [1, 1, 1, 0]


def test_chunk_capacities_skip_sizes_below_the_largest_parameter():
    prof = chain_profile(block_params=(1000, 1000, 1000), pre_params=10, param_bytes=2)
    # 4000 and 8000 bytes exceed the model: capped at it (3010), plus its half (1505)
    assert chunk_capacities(prof, (1000, 4000, 8000)) == (1505, 2000, 3010)
    # a model smaller than every size: the whole model, and halves, quarters, eighths of it
    small = chain_profile(block_params=(100,) * 7, pre_params=100)
    assert chunk_capacities(small, (64 * 2**20,)) == (100, 200, 400, 800)
    # none fits: the largest parameter rounded up to a MiB, and twice that
    big = chain_profile(block_params=(3 * 2**20,), pre_params=10, param_bytes=2)
    assert chunk_capacities(big, (2**20,)) == (3 * 2**20, 6 * 2**20)
    with pytest.raises(ValueError, match="largest parameter"):
        build_layout(prof, 999)


def test_why_a_chunk_must_persist_names_its_parameters_and_parts():
    """Tied embeddings are one reason; parameters of parts far apart packed side by side (an
    unused expert at the tail, next to the head) are another: the note names what it sees."""
    from protrain.layout import why_persistent
    prof = chain_profile(block_params=(100, 100), pre_params=100, tied=True)
    names = tuple(p.name for p in prof.parts)
    layout = build_layout(prof, 100)
    assert why_persistent(prof.params, layout, names) == (
        "chunk 0 is used by <pre>, <post> but not by h.0, h.1 in between: it holds pre.w (used "
        "by <pre> and <post>)")
    params = prof.params[:3] + (ParamRecord("post.w", 50, (3,)), ParamRecord("h.0.expert.w", 50, (1,)))
    params = (ParamRecord("pre.w", 100, (0,)),) + params[1:]
    layout = build_layout(ModelProfile("x", "measured", "cpu", 4, params, prof.parts), 100)
    assert layout.min_persist == 4
    assert why_persistent(params, layout, names) == (
        "chunk 3 is used by h.0, <post> but not by h.1 in between: it holds h.0.expert.w (used by "
        "h.0), post.w (used by <post>)")

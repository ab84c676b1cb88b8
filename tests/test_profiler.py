"""Profiler on CPU: activation bytes, peaks the memory model can rebuild, streaming, hygiene."""
import time

import numpy as np
import pytest
import torch
from torch import nn

from protrain.block_mode import layout_block_modes
from protrain.cost.memory import activation_walk
from protrain.models import GPT, GPTConfig, synthetic_batch
from protrain.measure import profiler
from protrain.profile.blocks import find_blocks
from protrain.runtime.meter import OpRecorder, StorageMeter, StorageRegistry
from protrain.profile.model_profile import ModelProfile
from protrain.measure.profiler import drop_param_grads, profile_model
from protrain.runtime.activations import checkpointed_blocks

CFG = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = synthetic_batch(CFG, 2)
    prof = profile_model(model, lambda m: m(x, y), progress=False, micro_batch=2, seq_len=64)
    return model, x, y, prof


def test_activation_bytes_equal_what_autograd_saved(gpt):
    model, x, y, prof = gpt
    # Counted independently: distinct storages passed to autograd's pack hook, minus the
    # parameters and the batch.
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()}
    excluded |= {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}
    seen, keep = {}, []

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in excluded:
            seen.setdefault(st.data_ptr(), st.nbytes())
        keep.append(t)  # keep storages alive so addresses are not reused
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    assert sum(seen.values()) == sum(p.saved_bytes for p in prof.parts)
    assert sum(seen.values()) > 0
    # Every block saves the same, and more than its input (which it saves too).
    blocks = prof.blocks
    assert len({b.saved_bytes for b in blocks}) == 1
    assert blocks[0].saved_bytes > blocks[0].in_bytes == 2 * 64 * 64 * 4
    del loss


def _measured_peak(model, x, y, modes):
    """Run forward + backward with the given block modes (CKPT through torch's non-reentrant
    checkpoint) and return the peak live activation bytes, as the profiler counts them."""
    reg = StorageRegistry("cpu")
    peak = [0]
    recorder = OpRecorder(reg, StorageMeter(reg),
                          lambda n, b, pk, a: peak.__setitem__(0, max(peak[0], pk)), {}, lambda i: None)
    with checkpointed_blocks(model.transformer.h, modes), drop_param_grads(model.parameters()), recorder:
        model(x, y).backward()
    return peak[0]


@pytest.mark.parametrize("n_ckpt", range(CFG.n_layer + 1))
def test_memory_model_rebuilds_the_measured_peak(gpt, n_ckpt):
    model, x, y, prof = gpt
    modes = layout_block_modes(CFG.n_layer, 0, n_ckpt)
    predicted, _ = activation_walk(prof, np.array([[m.code for m in modes]]))
    measured = _measured_peak(model, x, y, modes)
    assert predicted[0] == pytest.approx(measured, rel=0.01)
    if n_ckpt == 0:
        assert predicted[0] == measured == prof.activation_peak_keep_all()


def test_parts_params_and_times(gpt):
    model, _, _, prof = gpt
    assert [p.kind for p in prof.parts] == ["pre"] + ["block"] * 4 + ["post"]
    assert [p.name for p in prof.blocks] == [f"transformer.h.{i}" for i in range(4)]
    names = [r.name for r in prof.params]
    assert names[0] == "transformer.wte.weight" and names[1] == "transformer.wpe.weight"
    assert prof.params[0].parts == (0, 5)            # tied head: used again by <post>
    assert names[-2:] == ["transformer.ln_f.weight", "transformer.ln_f.bias"] or \
        set(names[-2:]) == {"transformer.ln_f.weight", "transformer.ln_f.bias"}
    assert sum(r.numel for r in prof.params) == sum(p.numel() for p in model.parameters())
    assert all(p.fwd_time > 0 and p.bwd_time > 0 for p in prof.blocks)
    assert prof.param_bytes == 4 and prof.source == "measured" and prof.device == "cpu"
    # Block-by-block execution order: each block's parameters right after the previous one's.
    block_of = [r.parts[0] for r in prof.params]
    assert block_of == sorted(block_of)


def test_profile_json_round_trip(gpt, tmp_path):
    prof = gpt[3]
    prof.save(tmp_path / "p.json")
    assert ModelProfile.load(tmp_path / "p.json") == prof


def test_profiling_changes_neither_weights_nor_rng():
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, dropout=0.1)
    torch.manual_seed(1)
    model = GPT(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = synthetic_batch(cfg, 2)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    profile_model(model, lambda m: m(x, y), progress=False)
    assert torch.equal(torch.rand(3), expected_next)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_streamed_profile_matches_and_holds_one_block(monkeypatch):
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = synthetic_batch(CFG, 2)
    plain = profile_model(model, lambda m: m(x, y), progress=False)
    loaded_counts = []
    real_load = profiler._ParamStreamer.load

    def load(self, i):
        real_load(self, i)
        loaded_counts.append(len(self.loaded))
    monkeypatch.setattr(profiler._ParamStreamer, "load", load)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    streamed = profile_model(model, lambda m: m(x, y), progress=False, stream_params=True)
    assert loaded_counts and max(loaded_counts) == 1   # one block's parameters at a time
    for a, b in zip(plain.parts, streamed.parts):
        assert (a.saved_bytes, a.in_bytes, a.fwd_start, a.fwd_peak, a.bwd_start, a.bwd_peak) == \
               (b.saved_bytes, b.in_bytes, b.fwd_start, b.fwd_peak, b.bwd_start, b.bwd_peak), a.name
    assert [r.parts for r in plain.params] == [r.parts for r in streamed.params]
    for k, v in model.state_dict().items():  # parameters are back, unchanged
        assert torch.equal(v, before[k]), k


def test_finds_blocks_of_common_layouts():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    assert find_blocks(gpt2)[0] == "transformer.h"
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64))
    name, blocks = find_blocks(llama)
    assert name == "model.layers" and len(blocks) == 3

    class Megatronish(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(8, 4)
            self.decoder = nn.Module()
            self.decoder.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])  # smaller decoy
    assert find_blocks(Megatronish())[0] == "decoder.layers"
    # No list of repeated blocks: the top-level modules that hold parameters, looking through
    # a wrapper (one child holding them all) and containers (ModuleList) into what they hold.
    mlp = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    name, blocks = find_blocks(nn.ModuleDict({"net": mlp}))
    assert blocks == [mlp[0], mlp[2]] and name == "top-level modules net.0, net.2"
    with pytest.raises(ValueError, match="no module holding parameters"):
        find_blocks(nn.Sequential(nn.ReLU()))


def test_profiles_a_hugging_face_model_with_tuple_outputs():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 64, (2, 16))
    prof = profile_model(model, lambda m: m(input_ids=ids, labels=ids).loss, progress=False)
    assert prof.n_blocks == 2
    assert all(b.bwd_time > 0 and b.saved_bytes > 0 for b in prof.blocks)
    assert prof.parts[-1].saved_bytes > 0      # logits / loss


def test_step_must_return_the_loss(gpt):
    model, x, y, _ = gpt
    with pytest.raises(TypeError, match="scalar loss"):
        profile_model(model, lambda m: m(x), progress=False)


def test_uploads_of_streamed_weights_are_timed_as_no_part(monkeypatch):
    """Streaming a block's weights in takes time at every boundary; the profile must not charge
    it to the part before (nor to the one after), or the planner trusts overlap it will not
    get. The profiler's clock is made to jump 10 s in every upload (a sleep would also slow
    the CPU kernels after it): part times must not see the jumps."""
    import types
    jump = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + jump[0])
    monkeypatch.setattr(profiler, "time", clock)
    real_load = profiler._ParamStreamer.load

    def slow_load(self, i):
        if i not in self.loaded:
            jump[0] += 10.0
        real_load(self, i)
    monkeypatch.setattr(profiler._ParamStreamer, "load", slow_load)
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = synthetic_batch(CFG, 2)
    prof = profile_model(model, lambda m: m(x, y), progress=False, stream_params=True)
    total = sum(p.fwd_time + p.bwd_time for p in prof.parts)
    assert jump[0] >= 8 * 10.0 * 4                 # 4 passes, 4 blocks up and down
    assert total < 5.0, [(p.name, p.fwd_time, p.bwd_time) for p in prof.parts]
    assert 0.2 < prof.hooked_slowdown < 5          # the plain pass's uploads taken out too


def test_streaming_gives_the_parameters_back_and_its_pinned_memory(monkeypatch):
    """The host copies of streamed weights are pinned (on CUDA) for the profile only: after
    it, every parameter has a tensor of its own again (not a view of a pinned region) with
    its values, and nothing stays registered."""
    from deferred_streams import deferred_streams
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = synthetic_batch(CFG, 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with deferred_streams(monkeypatch) as made:
        profile_model(model, lambda m: m(x, y), progress=False, stream_params=True)
    assert made and made[-1].registrations > 0 and made[-1].pinned_bytes() == 0
    for n, p in model.named_parameters():
        assert torch.equal(p.data, before[n]), n
        assert p.data.untyped_storage().nbytes() == p.numel() * p.element_size(), n


def test_parameters_forward_never_used_are_packed_with_their_block():
    """Experts no token reached in the profiled batch are placed with their block (before the
    next block's parameters), not at the tail beside the head: no chunk is then used by parts
    that are not adjacent, and none has to persist."""
    from protrain.layout import build_layout
    from sparse_models import MoEGPT
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, tie_embeddings=False)
    torch.manual_seed(0)
    model = MoEGPT(cfg, n_experts=8)
    x, y = synthetic_batch(cfg, 1)
    prof = profile_model(model, lambda m: m(x, y), progress=False, micro_batch=1, seq_len=16)
    names = [rec.name for rec in prof.params]
    model(x, y).backward()
    unused = [n for n, p in model.named_parameters() if p.grad is None]
    assert any(n.startswith("transformer.h.0.mlp.experts.") for n in unused)
    homes = [rec.parts[0] for rec in prof.params]
    assert homes == sorted(homes)                        # in order of their parts, tail included
    block0 = [n for n in names if n.startswith("transformer.h.0.")]
    assert names.index(block0[-1]) < names.index("transformer.h.1.ln_1.weight")
    layout = build_layout(prof, max(rec.numel for rec in prof.params))
    assert layout.min_persist == 0


def test_the_profile_cache_key_reads_the_profilers_own_files():
    """The cache key hashes the profiler's source files by path; a file moved or renamed
    without updating the list would silently drop out of the key (hashed as unreadable)."""
    from protrain.profile import cache
    missing = [f for f in cache._PROFILER_FILES if not (cache._PACKAGE / f).is_file()]
    assert not missing, f"profile cache key lists files that do not exist: {missing}"

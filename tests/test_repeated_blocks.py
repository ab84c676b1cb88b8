"""Blocks entered more than once per forward (issue 32): a module listed several times in the block
list (weights shared across layers) and a block called again right after itself (ALBERT's layer
groups, a loop over one layer) train bit for bit as plain DeepSpeed ZeRO-0 does, with offloaded
chunks and swapped / checkpointed blocks; a block called after a later one is planned with
coarser blocks, or refused naming it where protrain.blocks names its list."""
import copy
import functools

import pytest
import torch
from torch import nn

import dstrain  # noqa: F401  (the one-rank distributed environment, before deepspeed starts)
import deepspeed
from dstrain import UNTIED, base_config, with_protrain

from protrain.block_mode import BlockMode
from protrain.models import GPT, synthetic_batch
from protrain.profile.cache import cache_key
from protrain.runtime.boundaries import BlockOrderError

STEPS = 4
CLIP = {"gradient_clipping": 1.0}
# 64 KiB chunks (the largest parameter: the embedding); one swapped and one checkpointed block.
PINS = dict(chunk_size="64KiB", n_swap=1, n_checkpoint=1)
# The fewest buffers the GPT's layout allows (a block spans 7 chunks): a block called again
# right after itself re-enters its part, whose chunks the prefetch has pushed out by then.
LOOP = dict(PINS, n_persist=1, n_buffer=7)


class LoopGPT(GPT):
    """Each block called ``repeat`` times in a row (``for _ in range(k): x = layer(x)``); with
    ``laps`` > 1 the whole list is run again (l0, l1, l0, l1: out of order)."""

    repeat, laps = 2, 1

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for _ in range(self.laps):
            for block in self.transformer.h:
                for _ in range(self.repeat):
                    x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt(listing: str = "", laps: int = 1) -> GPT:
    """The tiny untied GPT; ``listing`` (e.g. "0000", "0101") lists its first blocks again in
    the block list (the others are dropped); "loop": each block called twice in a row."""
    torch.manual_seed(0)
    if listing == "loop":
        model = LoopGPT(UNTIED)
        model.laps = laps
        return model
    model = GPT(UNTIED)
    h = model.transformer.h
    model.transformer.h = nn.ModuleList([h[int(k)] for k in listing])
    return model


def albert(groups: int, inner: int):
    transformers = pytest.importorskip("transformers")
    AlbertConfig, AlbertForMaskedLM = transformers.AlbertConfig, transformers.AlbertForMaskedLM
    torch.manual_seed(0)
    return AlbertForMaskedLM(AlbertConfig(
        vocab_size=128, embedding_size=16, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=64, num_hidden_groups=groups, inner_group_num=inner, max_position_embeddings=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def build(spec: tuple):
    """("gpt", listing[, laps]) or ("albert", groups, inner)."""
    return gpt(*spec[1:]) if spec[0] == "gpt" else albert(*spec[1:])


def run(ds_config: dict, spec: tuple, steps: int = STEPS, on_step=None, model=None):
    """Train the model of ``spec`` for ``steps`` steps; (losses, final weights, global grad
    norms, engine)."""
    hf = spec[0] == "albert"
    model = model or build(spec)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=copy.deepcopy(ds_config))
    losses, norms = [], []
    for i in range(steps):
        if hf:
            x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i))
            loss = engine(input_ids=x, labels=x).loss
        else:
            loss = engine(*synthetic_batch(UNTIED, 2, 16, seed=i))
        engine.backward(loss)
        grads = [p.grad.norm() for p in model.parameters() if p.grad is not None]   # DeepSpeed's
        norms.append(float(torch.stack(grads).norm()) if grads else None)
        engine.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(engine)
    state = model.state_dict()
    weights = {n: state[n].detach().clone() for n, _ in model.named_parameters()}
    return losses, weights, norms, engine


@functools.lru_cache(maxsize=None)
def deepspeed_run(spec: tuple, clip: bool):
    losses, weights, norms, engine = run(base_config(**(CLIP if clip else {})), spec)
    engine.destroy()
    return losses, weights, norms


@pytest.fixture(scope="module")
def profiles(tmp_path_factory) -> str:
    """A profile cache: each model is profiled once in this file."""
    return str(tmp_path_factory.mktemp("profiles"))


def assert_same_as_deepspeed(spec: tuple, clip: bool, pins: dict):
    ref_losses, ref_weights, ref_norms = deepspeed_run(spec, clip)
    if clip:
        assert max(ref_norms) > 1.0          # the clipping is not a no-op
    losses, weights, _, engine = run(with_protrain(base_config(**(CLIP if clip else {})), **pins), spec)
    plan, runtime = engine.protrain_plan, engine.protrain_runtime
    assert losses == ref_losses
    assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())
    assert runtime.chunks.offloaded()
    assert not runtime.optimizer._late       # no gradient came after its chunk left the device
    engine.destroy()
    return plan


# The fewest persistent chunks each listing's layout allows: [a, b, a, b] uses a's and b's
# chunks in parts that are not adjacent, which keeps them (and those before) on the device:
# all but the head's.
LEAST_PERSISTENT = {"0000": 1, "0101": 13}


@pytest.mark.parametrize("listing, clip", [("0000", False), ("0000", True), ("0101", True)],
                         ids=["[blk] * 4", "[blk] * 4, clipping 1.0", "[a, b, a, b], clipping 1.0"])
def test_a_block_listed_several_times_trains_like_deepspeed(listing, clip, profiles):
    """nn.ModuleList([blk] * 4) and [a, b, a, b]: before, every listing of a module fired every
    listing's hooks, the parts went round in circles, and chunks were offloaded several times
    in one backward - parameters copied over their gradients (grad norm 12.3 for 1.55)."""
    plan = assert_same_as_deepspeed(("gpt", listing), clip, dict(PINS, n_persist=LEAST_PERSISTENT[listing],
                                                                   profile_cache_dir=profiles))
    modes = plan.block_modes
    assert BlockMode.SWAP in modes and BlockMode.CKPT in modes
    # One module at positions of different modes: each call ran in its own position's mode.
    assert len({modes[i] for i, k in enumerate(listing) if k == listing[0]}) > 1


@pytest.mark.parametrize("clip, nvme", [(False, False), (True, True)],
                         ids=["swapped to host memory", "on NVMe, clipping 1.0"])
def test_a_block_called_twice_in_a_row_trains_like_deepspeed(clip, nvme, profiles, tmp_path):
    """Before: the second call's input marked the part before the block as entered in backward,
    its swap stash was let go mid-backward (KeyError in activations.unpack); and re-entering
    the part found every buffer taken by the prefetch."""
    pins = dict(LOOP, n_swap=0, n_ssd=1, ssd_path=str(tmp_path), ssd_min_bytes=0) if nvme else LOOP
    plan = assert_same_as_deepspeed(("gpt", "loop"), clip, dict(pins, profile_cache_dir=profiles))
    assert {BlockMode.CKPT, BlockMode.SSD if nvme else BlockMode.SWAP} <= set(plan.block_modes)


def test_albert_layer_groups_train_like_deepspeed():
    """transformers' AlbertForMaskedLM, 4 layers in 2 groups: each group called twice in a row."""
    assert_same_as_deepspeed(("albert", 2, 1), True, dict(PINS, chunk_size="8KiB", n_persist=1))


@pytest.mark.parametrize("spec, key, first, then", [
    (("gpt", "loop", 2), "transformer.h", "transformer.h.0", "transformer.h.3"),
    (("albert", 1, 2), "albert.encoder.albert_layer_groups.0.albert_layers", "albert_layers.0",
     "albert_layers.1")],
    ids=["a GPT run twice through its blocks", "ALBERT, one group of two layers"])
def test_a_block_called_after_a_later_one_plans_coarser_blocks_or_is_refused_by_name(spec, key, first, then):
    """A block called after a later one cannot be a part of its own: with its list named in
    protrain.blocks that is refused, naming both blocks; found by ProTrain, the model is
    planned with coarser blocks (its top-level modules, else none) and trains like DeepSpeed."""
    from protrain.config import ConfigError
    said = rf"protrain.blocks = '{key}': ProTrain: block \S*{first} \(position 0\) was called again after block \S*{then}"
    with pytest.raises(ConfigError, match=said):
        run(with_protrain(base_config(), **PINS, blocks=key), spec, steps=1)
    hf = spec[0] == "albert"
    plan = assert_same_as_deepspeed(spec, True, dict(chunk_size="8KiB" if hf else "64KiB", n_persist=1))
    assert plan.blocks is not None and not any(first in b for b in plan.blocks), plan.blocks


def test_part_reentered_in_backward_does_not_offload_its_chunk_twice(profiles):
    """A part entered again in backward after its chunks' gradients left (an order the part
    boundaries do not produce for the models above, forced here: block 2's part again at the
    end of block 1's backward): its chunks are made resident again, parameters in their buffers, which were
    offloaded a second time over the gradients."""
    engines = []

    def reenter(g):
        runtime = engines[0].protrain_runtime if engines else None
        if runtime is not None and runtime.iterations > 0:
            runtime._on_enter("bwd", 3, None)
            runtime._on_enter("bwd", 2, None)

    def on_input(module, args):
        if args[0].requires_grad:
            args[0].register_hook(reenter)

    model = gpt("0123")
    model.transformer.h[1].register_forward_pre_hook(on_input)
    ref_losses, ref_weights, _ = deepspeed_run(("gpt", "0123"), False)
    cfg = with_protrain(base_config(), chunk_size="64KiB", n_persist=1, n_swap=0,
                        n_checkpoint=0, profile_cache_dir=profiles)
    losses, weights, _, engine = run(cfg, ("gpt", "0123"), model=model,
                                     on_step=lambda e: engines.append(e) if not engines else None)
    assert losses == ref_losses
    assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())
    engine.destroy()


def test_the_profile_cache_tells_apart_which_listings_share_a_module():
    """[a, b, a, b] and [a, b, b, a]: the same modules, parameters and code, other parts using
    them; a profile of one reused for the other would place their chunks wrongly."""
    batch = synthetic_batch(UNTIED, 2, 16)
    keys = {cache_key(gpt(listing), batch, {}, torch.device("cpu")) for listing in ("0101", "0110", "0123")}
    assert len(keys) == 3


def test_a_chunk_whose_backward_is_over_is_not_uploaded_again_before_its_update(profiles):
    """Only the head's chunk offloaded: the last block's part holds no offloaded chunk, and the
    backward prefetch, starting from the highest chunk, uploaded the head's again right after
    its gradients left - before its update; the next forward then ran on the old head (found
    with [a, b, a, b] above, whose layout keeps every other chunk on the device)."""
    ref_losses, ref_weights, _ = deepspeed_run(("gpt", "0123"), False)
    cfg = with_protrain(base_config(), chunk_size="64KiB", n_persist=23, n_swap=0, n_checkpoint=0,
                        profile_cache_dir=profiles)
    losses, weights, _, engine = run(cfg, ("gpt", "0123"))
    assert [s.name for c in engine.protrain_runtime.chunks.offloaded() for s in c.slots] == ["lm_head.weight"]
    assert losses == ref_losses
    assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())
    engine.destroy()


def test_a_module_listed_twice_is_wrapped_once_and_unwrapped_whole():
    """checkpoint, torch.compile and Ulysses attention wrap each block's forward: before, a
    module listed twice was wrapped twice (a checkpoint inside a checkpoint, heads exchanged
    twice) and left wrapped after close; modes that differ between its positions follow the
    position running."""
    from protrain.runtime.activations import checkpointed_blocks
    from protrain.runtime.compile import CompiledBlocks, CompileRequest
    from protrain.sp.ulysses import ulysses_blocks
    blk = nn.Linear(4, 4)
    blocks = [blk, blk]
    none, ckpt = BlockMode.NONE, BlockMode.CKPT
    with checkpointed_blocks(blocks, [ckpt, ckpt]):
        assert blk.forward.func.__name__ == "_checkpointed" and not hasattr(blk.forward.args[0], "func")
    compiled = CompiledBlocks(blocks, [none, none], CompileRequest.from_options("eager", "test"))
    assert compiled.compiled == [0, 1]
    compiled.close()
    with ulysses_blocks(blocks, None, 2) as modes:
        assert modes[0] is modes[1] and not hasattr(blk.forward.args[0], "func")
    assert "forward" not in blk.__dict__
    with pytest.raises(ValueError, match="listed at positions"):
        with checkpointed_blocks(blocks, [ckpt, none]):
            pass
    running, ran = [0], []
    with checkpointed_blocks(blocks, [ckpt, none], position=lambda: running[0]):
        for running[0] in (0, 1):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: ran.append(running[0]) or t, lambda t: t):
                blk(torch.ones(2, 4, requires_grad=True))
    assert "forward" not in blk.__dict__
    assert ran.count(0) < ran.count(1)     # the checkpointed position kept less (not its weight)

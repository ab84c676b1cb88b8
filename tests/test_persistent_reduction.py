"""Persistent chunks' gradient all-reduce on several ranks (issue 35, item 5): started as the
chunk's backward ends, under the rest of the backward, and waited for in step(); a chunk that
gets gradients after its backward (a parameter used outside the part it was profiled in) is
found in the plan's first step and reduced in step(); one that starts doing so later is
refused by name, not summed wrong."""
import json
import os

import pytest
import torch

from dstrain import TINY, base_config, with_protrain

# Every chunk persistent: the extra use below lands in one.
PERSISTENT = dict(chunk_size="64KiB", n_persist="all", n_checkpoint=0, n_swap=0)


def _rank(rank, world, port, out_dir, when):
    """Plain DeepSpeed ZeRO-0 with block 0 also using block 3's ln_1.bias from the start, then
    ProTrain profiled without that use, which begins at the plan's first step (``when`` =
    "first") or its third ("later")."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed
    from protrain.models import GPT, synthetic_batch
    from protrain_ds import engine as engine_mod
    use = {"on": True}

    def run(cfg, steps=4):
        torch.manual_seed(0)
        model = GPT(TINY)
        bias = model.transformer.h[3].ln_1.bias
        model.transformer.h[0].register_forward_hook(lambda m, a, out: out + bias if use["on"] else out)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = []
        for i in range(steps):
            if when == "later" and i == 2:
                use["on"] = True
            x, y = synthetic_batch(TINY, 2, seed=10 * rank + i)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        state = model.state_dict()
        return losses, {n: state[n].tolist() for n, _ in model.named_parameters()}, engine

    got = {}
    cfg = base_config(gradient_clipping=1.0)
    got["plain"] = run(cfg)[:2]
    build = engine_mod.ProTrainEngine._protrain_build_runtime

    def build_then_use(self, *a, **k):              # profiled without the extra use
        build(self, *a, **k)
        use["on"] = when == "first"
    engine_mod.ProTrainEngine._protrain_build_runtime = build_then_use
    use["on"] = False
    try:
        losses, weights, engine = run(with_protrain(cfg, **PERSISTENT))
        opt = engine.protrain_runtime.optimizer
        got["protrain"] = [losses, weights]
        got["late"] = sorted(opt._late_persistent)
        got["persistent"] = sum(c.persistent for c in engine.protrain_runtime.chunks.chunks)
        got["overlapped"] = engine.protrain_stats()["reductions_overlapped"]
    except RuntimeError as e:
        got["error"] = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


def _launch(tmp_path, when):
    from dpworker import free_port
    from ranks import start_ranks
    start_ranks(_rank, (2, free_port(), str(tmp_path), when), 2)
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]


def test_reductions_run_under_backward_and_a_late_gradient_is_reduced_in_step(tmp_path):
    """Block 3's chunk gets a gradient from block 0's backward, after its own: learnt in the
    first step, so its all-reduce waits for step() while the others' run under backward;
    losses and weights equal DeepSpeed ZeRO-0's on both ranks."""
    for g in _launch(tmp_path, "first"):
        assert "error" not in g, g.get("error")
        assert len(g["late"]) == 1, g["late"]
        # steps 2-4 start every persistent chunk's all-reduce but the late one's under backward
        assert g["overlapped"] == 3 * (g["persistent"] - 1) > 0, g
        assert g["protrain"][0] == g["plain"][0]
        for name, w in g["plain"][1].items():
            assert g["protrain"][1][name] == w, name


def test_a_parameter_used_outside_its_part_after_the_first_step_is_refused_by_name(tmp_path):
    """The extra use begins at the third step: the late gradient would be added to a chunk
    whose sum is already on its way over the ranks."""
    for g in _launch(tmp_path, "later"):
        assert "began its all-reduce over the 2 ranks" in g.get("error", ""), g.get("error")
        assert "ln_1.bias" in g["error"] and "first step of a plan" in g["error"]

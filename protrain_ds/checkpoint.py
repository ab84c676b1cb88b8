"""Checkpoints of a ProTrain engine, in DeepSpeed's directory conventions.

    save_dir/latest                     the tag of the newest complete checkpoint
    save_dir/<tag>/protrain_meta.pt     plan, world size, counters, LR scheduler, loss scaler,
                                        client_state, parameter names and shapes (rank 0)
    save_dir/<tag>/protrain_states_rank00000.pt
                                        that rank's pieces of every parameter: fp32 master,
                                        Adam m and v, step (see protrain.runtime.states), RNG
    save_dir/<tag>/manifest.json        every file's size and CRC32, written last

Atomic: everything is written into ``save_dir/.<tag>.partial``; only when every rank has
written and rank 0 has checked the files and written the manifest is the directory renamed to
``<tag>``, and ``latest`` replaced (write then rename). A crash mid-save leaves the previous
checkpoint and ``latest`` untouched. Loading verifies the manifest, sizes and checksums and
names the file that is missing, short or corrupt.

The pieces of all ranks together cover every parameter once, so a checkpoint loads into any
world size. ``consolidated_state_dict`` assembles the fp32 weights for inference (DeepSpeed's
zero_to_fp32); ``python -m protrain_ds.checkpoint DIR OUT.pt`` writes them to a file.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from collections import defaultdict
from pathlib import Path

import torch

from protrain.config import ConfigError
from protrain.runtime.states import Piece, assemble, export_pieces, import_pieces

META = "protrain_meta.pt"
MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and what is wrong with it."""


def _states_file(rank: int) -> str:
    return f"protrain_states_rank{rank:05d}.pt"


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def _barrier(dp) -> None:
    if dp.world > 1:
        torch.distributed.barrier(group=dp.group)


def save(engine, save_dir, tag=None, client_state=None, save_latest=True) -> bool:
    runtime = engine.protrain_runtime
    if runtime is None:
        raise CheckpointError("nothing to checkpoint yet: ProTrain builds its state at the first "
                              "forward pass; save after a training step")
    runtime.optimizer.worker.drain()
    dp = runtime.chunks.dp
    save_dir = Path(save_dir)
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    if "/" in tag or tag.startswith("."):
        raise ConfigError(f"checkpoint tag {tag!r}: use a plain name (no '/', not starting with '.')")
    partial = save_dir / f".{tag}.partial"
    if dp.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier(dp)
    pieces = [vars(p) for p in export_pieces(runtime.chunks)]
    rng = {"cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    _atomic_save({"pieces": pieces, "rng": rng, "rank": dp.rank, "world": dp.world},
                 partial / _states_file(dp.rank))
    if dp.rank == 0:
        opt = engine.optimizer
        meta = {
            "format": FORMAT, "world": dp.world, "tag": tag,
            "plan": engine.protrain_plan.to_dict(),
            "params": _param_shapes(engine),
            "extra_state": _extra_state(engine.module),
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "loss_scaler": vars(opt.loss_scaler).copy() if opt.loss_scaler is not None else None,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "client_state": client_state or {},
        }
        _atomic_save(meta, partial / META)
    _barrier(dp)
    if dp.rank == 0:
        files = {f.name: {"bytes": f.stat().st_size, "crc32": _crc32(f)}
                 for f in sorted(partial.iterdir()) if f.name != MANIFEST}
        expected = {META} | {_states_file(r) for r in range(dp.world)}
        if set(files) != expected:
            raise CheckpointError(f"{partial}: expected files {sorted(expected)}, found {sorted(files)}")
        _atomic_write(partial / MANIFEST, json.dumps(
            {"format": FORMAT, "tag": tag, "world": dp.world, "complete": True, "files": files}, indent=1))
        final = save_dir / tag
        old = save_dir / f".{tag}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        partial.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        if save_latest:
            _atomic_write(save_dir / "latest", tag)
    _barrier(dp)
    return True


def resolve(load_dir, tag=None) -> Path | None:
    load_dir = Path(load_dir)
    if tag is None:
        latest = load_dir / "latest"
        if not latest.exists():
            return None
        tag = latest.read_text().strip()
    return load_dir / str(tag)


def verify(path: Path) -> dict:
    """The manifest of a complete, intact checkpoint directory, or CheckpointError."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    manifest = path / MANIFEST
    if not manifest.exists():
        raise CheckpointError(f"checkpoint {path} is incomplete: {MANIFEST} is missing (the save "
                              f"was interrupted); load an earlier tag")
    try:
        info = json.loads(manifest.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt ({e})") from None
    if not info.get("complete") or info.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: not a complete ProTrain checkpoint (format "
                              f"{info.get('format')}, complete={info.get('complete')})")
    for name, want in info["files"].items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {name} has {size} bytes, the manifest says "
                                  f"{want['bytes']} (truncated or overwritten)")
        if _crc32(f) != want["crc32"]:
            raise CheckpointError(f"checkpoint {path}: {name} fails its checksum (corrupt)")
    return info


def read_pieces(path: Path, world: int) -> dict[str, list[Piece]]:
    by_name: dict[str, list[Piece]] = defaultdict(list)
    for r in range(world):
        blob = torch.load(path / _states_file(r), map_location="cpu", weights_only=False, mmap=True)
        for d in blob["pieces"]:
            by_name[d["name"]].append(Piece(**d))
    return by_name


def load(engine, load_dir, tag=None, *, load_optimizer_states=True, load_lr_scheduler_states=True,
         load_module_only=False):
    path = resolve(load_dir, tag)
    if path is None:
        return None, None
    info = verify(path)
    meta = torch.load(path / META, map_location="cpu", weights_only=False)
    have = _param_shapes(engine)
    want = meta["params"]
    mismatch = [n for n in want if have.get(n) != want[n]] + sorted(set(have) - set(want))
    if mismatch:
        raise CheckpointError(f"checkpoint {path} was saved from another model: parameters "
                              f"{mismatch[:3]} differ")
    if engine.protrain_runtime is None:
        from protrain.plan import Plan
        engine._protrain_build_runtime(Plan.from_dict(meta["plan"]))
    runtime = engine.protrain_runtime
    runtime.optimizer.worker.drain()
    pieces = read_pieces(path, info["world"])
    with_optimizer = load_optimizer_states and not load_module_only
    import_pieces(runtime.chunks, lambda n, lo, hi: assemble(pieces, n, lo, hi),
                  optimizer_states=with_optimizer)
    runtime.resume_optimizer()
    runtime.optimizer._dirty = True
    runtime.optimizer.zero_grad()
    if meta.get("extra_state"):
        engine.module.load_state_dict(meta["extra_state"], strict=False)
    if load_module_only:
        return str(path), meta["client_state"]
    for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
        setattr(engine, k, meta[k])
    opt = engine.optimizer
    for g, saved in zip(opt.param_groups, meta["param_groups"]):
        g.update(saved)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    if opt.loss_scaler is not None and meta["loss_scaler"] is not None:
        vars(opt.loss_scaler).update(meta["loss_scaler"])
    dp = runtime.chunks.dp
    if info["world"] == dp.world:
        rng = torch.load(path / _states_file(dp.rank), map_location="cpu", weights_only=False,
                         mmap=True)["rng"]
        torch.random.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return str(path), meta["client_state"]


def consolidated_state_dict(load_dir, tag=None) -> dict[str, torch.Tensor]:
    """fp32 weights of every trainable parameter, assembled from all ranks' pieces (for
    inference or for loading without ProTrain; tied parameters appear under their first name)."""
    path = resolve(load_dir, tag)
    if path is None:
        raise CheckpointError(f"{load_dir}: no 'latest' file; give the tag")
    info = verify(path)
    meta = torch.load(path / META, map_location="cpu", weights_only=False)
    pieces = read_pieces(path, info["world"])
    out = {}
    for name, shape in meta["params"].items():
        numel = 1
        for d in shape:
            numel *= d
        out[name] = assemble(pieces, name, 0, numel)[0].view(shape)
    return out


def _param_shapes(engine) -> dict[str, list[int]]:
    """Trainable parameters' shapes (from the runtime's slots when it exists: a sharded
    parameter's ``.data`` is empty between uses)."""
    rt = engine.protrain_runtime
    if rt is not None:
        return {s.name: list(s.shape) for c in rt.chunks.chunks for s in c.slots}
    return {n: list(p.shape) for n, p in engine.module.named_parameters() if p.requires_grad}


def _extra_state(module) -> dict:
    """What the module's state_dict holds besides trainable parameters (buffers, frozen
    parameters)."""
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if k not in trainable}


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="Write the fp32 weights of a ProTrain checkpoint "
                                             "(all ranks assembled) as a torch state_dict file.")
    ap.add_argument("checkpoint_dir", help="the save_dir given to engine.save_checkpoint")
    ap.add_argument("output", help="output file (torch.save of a state_dict)")
    ap.add_argument("--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    args = ap.parse_args(argv)
    try:
        sd = consolidated_state_dict(args.checkpoint_dir, args.tag)
    except CheckpointError as e:
        print(f"protrain_ds.checkpoint: {e}")
        return 2
    torch.save(sd, args.output)
    print(f"wrote {len(sd)} tensors ({sum(t.numel() for t in sd.values()) / 1e6:.1f} M fp32 "
          f"parameters) to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

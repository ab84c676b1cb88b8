"""Checkpoints of a ProTrain engine, in DeepSpeed's directory conventions.

    save_dir/latest                     the tag of the newest complete checkpoint
    save_dir/<tag>/protrain_meta.pt     plan, world size, counters, LR scheduler, loss scaler,
                                        client_state, parameter names and shapes (rank 0)
    save_dir/<tag>/protrain_states_rank00000.pt
                                        that rank's pieces of every parameter: fp32 master,
                                        Adam m and v, step (see protrain.runtime.states), RNG
    save_dir/<tag>/manifest.json        every file's size and CRC32, written last
    save_dir/<tag>/mp_rank_00_model_states.pt, zero_pp_rank_*_mp_rank_00_*_states.pt,
    save_dir/zero_to_fp32.py            the files plain DeepSpeed writes for the JSON's ZeRO
                                        stage, for DeepSpeed's tools and scripts that read
                                        them (zero_files.py)

Crash-safe, step by step (tests/test_checkpoint.py kills a save before every file-system
change it makes and loads what is left):

1. rank 0 repairs what an earlier killed save left (``_repair``) and makes
   ``save_dir/.<tag>.partial``;
2. every rank writes its files into it, each flushed to the drive (fsync) before it reports;
3. rank 0 checks that every expected file is there, writes the manifest (fsync) and syncs the
   directory: from now on ``.<tag>.partial`` is a complete checkpoint;
4. an existing ``<tag>`` (a tag saved again) is renamed to ``.<tag>.old``; ``.<tag>.partial``
   is renamed to ``<tag>``; ``latest`` is replaced (write aside, fsync, rename); the directory
   is synced after every rename, so the order survives a power loss;
5. ``.<tag>.old`` is removed.

A kill anywhere leaves ``latest`` naming a complete checkpoint: until step 4 the previous one
is untouched; between the two renames of step 4 ``<tag>`` is missing and loading reads
``.<tag>.old`` instead; the next save puts it back or removes it and removes every leftover
``.partial``. A save that fails (disk full, an I/O error on any rank) removes its ``.partial``
and raises ``CheckpointError`` naming the rank, the file and the cause. Loading verifies the
manifest (it must list exactly the files of a checkpoint of its world size), sizes and
checksums, and names the file that is missing, short or corrupt.

The pieces of all ranks together cover every parameter once, so a checkpoint loads into any
world size. ``consolidated_state_dict`` assembles the fp32 weights for inference (DeepSpeed's
zero_to_fp32); ``python -m protrain_ds.checkpoint DIR OUT.pt`` writes them to a file.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from protrain.config import ConfigError
from protrain.runtime.collectives import DataParallel
from protrain.runtime.states import Piece, RuntimeState, assemble, export_pieces
from protrain.units import fmt_bytes

from . import zero_files

log = logging.getLogger("protrain")

META = "protrain_meta.pt"
MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used or written; the message names the file and what is wrong."""


def _states_file(rank: int) -> str:
    return f"protrain_states_rank{rank:05d}.pt"


def _expected_files(world: int, kind: int | None = None) -> set[str]:
    """The files of a checkpoint of ``world`` ranks (``kind``: with DeepSpeed's files of that
    layout, zero_files.py)."""
    return {META} | {_states_file(r) for r in range(world)} | \
        (zero_files.files(world, kind) if kind is not None else set())


def _crc32(path: Path) -> int:
    # Into one small buffer: a save checks files of states that may not fit in host memory.
    crc, buf = 0, bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


# ---- saving --------------------------------------------------------------------------------
def save(engine, save_dir, tag=None, client_state=None, save_latest=True,
         exclude_frozen_parameters=False) -> bool:
    """``exclude_frozen_parameters``: as DeepSpeed, the frozen parameters' values are left out
    (a load keeps the loading model's own); their names are kept, so a load that would train
    one of them is refused as for any parameter saved frozen."""
    runtime = engine.protrain_runtime
    excluded = sorted(n for n, p in engine.module.named_parameters() if not p.requires_grad) \
        if exclude_frozen_parameters else []
    # Loaded and not planned yet: the loaded states are the ones to save.
    resume = engine._protrain_resume if runtime is None else None
    if runtime is not None:
        runtime.optimizer.worker.drain()
    dp = runtime.chunks.dp if runtime is not None else DataParallel()
    if not isinstance(save_dir, (str, os.PathLike)) or not os.fspath(save_dir):
        # DeepSpeed's check and exception: "" would write the checkpoint into the current directory.
        raise ValueError(f"save_checkpoint(save_dir={save_dir!r}): save_dir must be a non-empty "
                         f"string or path (the checkpoint's directory)")
    save_dir = Path(save_dir)
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    tag = _agreed_tag(engine, dp, tag)
    if not tag or "/" in tag or tag.startswith("."):
        raise ConfigError(f"checkpoint tag {tag!r}: use a plain name (no '/', not starting with '.')")
    partial = save_dir / f".{tag}.partial"

    def attempt(what: str, fn) -> str | None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported on every rank, see _settle
            return _describe(e, what, save_dir)
        return None

    # 1. A clean place to write.
    _settle(dp, tag, save_dir, attempt(f"preparing {partial}", lambda: _prepare(save_dir, tag))
            if dp.rank == 0 else None)

    # 2. Every rank's files, on the drive before anyone reports success.
    def write_files():
        # With the states of parameters frozen since they trained (trainable.py), which an
        # unfreeze after the resume goes on from.
        if runtime is not None:
            pieces = export_pieces(runtime.chunks) + engine._protrain_states.saved_pieces()
        elif resume is not None and resume.pieces is not None:
            pieces = resume.pieces if dp.rank == 0 else []   # every rank's, parked ones too
        else:
            pieces = _initial_pieces(engine, dp.rank)
        pieces = [vars(p) for p in pieces]
        rng = {"cpu": torch.random.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        _save_durable({"pieces": pieces, "rng": rng, "rank": dp.rank, "world": dp.world},
                      partial / _states_file(dp.rank))
        if dp.rank == 0:
            meta = _meta(engine, tag, dp.world, client_state, excluded)
            if resume is not None and resume.pieces is not None:
                meta.update(resume.meta)      # what the states loaded carry
            _save_durable(meta, partial / META)
    _settle(dp, tag, save_dir, attempt("writing its files", write_files))

    # 2b. The files plain DeepSpeed writes for the JSON's ZeRO stage (zero_files.py), cut from
    # every rank's files just written: DeepSpeed's tools and users' scripts read them.
    kind = zero_files.layout(engine.protrain_zero_stage)

    def write_deepspeed_files():
        keys, extra = _module_state(engine, excluded)
        zero_files.write(partial, dp.rank, dp.world, _param_shapes(engine), read_pieces(partial, dp.world),
                         extra, engine.module, _save_durable, kind=kind, groups=_group_names(engine),
                         engine_state=_deepspeed_state(engine, dp.world, client_state), keys=keys)
        if dp.rank == 0 and kind >= 2:
            zero_files.copy_recovery_script(save_dir)
    _settle(dp, tag, save_dir, attempt("writing DeepSpeed's files", write_deepspeed_files))

    # 3-5. Rank 0 certifies and publishes.
    error, published = None, []
    if dp.rank == 0:
        error = attempt(f"publishing {save_dir / tag}",
                        lambda: _commit(save_dir, tag, dp.world, save_latest, published, kind))
        if error and published:
            error += f" ({_PUBLISHED}: the checkpoint is complete in {save_dir / tag})"
    _settle(dp, tag, save_dir, error)
    return True


class CheckpointTagError(CheckpointError, AssertionError):
    """The ranks saved under different tags with ``checkpoint.tag_validation`` "FAIL" (an
    AssertionError, as DeepSpeed raises there)."""


def _agreed_tag(engine, dp: DataParallel, tag: str) -> str:
    """The one tag every rank saves under. DeepSpeed compares the ranks' tags
    (``checkpoint.tag_validation``): "FAIL" raises, "WARN" (its default) warns and "IGNORE"
    says nothing, and each rank writes its own files under its own tag. A ProTrain checkpoint
    is one directory holding every rank's files, so on a mismatch they all go under rank 0's
    tag (said under "WARN")."""
    if dp.world == 1:
        return tag
    tags = dp.all_gather_object(tag)
    if len(set(tags)) == 1:
        return tag
    by_rank = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
    msg = (f"[rank={dp.rank}] The checkpoint tag name '{tag}' is not consistent across all ranks "
           f"({by_rank}). Including rank unique information in checkpoint tag could cause issues "
           f"when restoring with different world sizes")
    if engine.checkpoint_tag_validation_fail():
        raise CheckpointTagError(f"{msg}: pass the same tag on every rank (or none: "
                                 f"global_step<N>), or set checkpoint.tag_validation to WARN")
    if engine.checkpoint_tag_validation_enabled():
        log.warning("%s; ProTrain saves every rank's files under rank 0's tag %r", msg, tags[0])
    return tags[0]


def _meta(engine, tag: str, world: int, client_state, excluded: list[str]) -> dict:
    opt = engine.optimizer
    return {
        "format": FORMAT, "world": world, "tag": tag,
        "plan": engine.protrain_plan.to_dict() if engine.protrain_plan is not None else None,
        "params": _param_shapes(engine),
        "parked": sorted(engine._protrain_states.parked),
        "step_counts": dict(engine._protrain_states.counts),
        "adam_chain": engine.protrain_runtime.adam_chain() if engine.protrain_runtime is not None else None,
        "extra_state": _extra_state(engine, excluded),
        "frozen_excluded": excluded,
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": vars(opt.loss_scaler).copy() if opt.loss_scaler is not None else None,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "client_state": client_state or {},
    }


def _repair(save_dir: Path) -> None:
    """Undo what saves killed before they finished left in ``save_dir``: their ``.partial``
    directories and ``latest``'s temporary file (removed: ``latest`` never names them), a
    ``.<tag>.old`` whose ``<tag>`` is back (removed), and one whose ``<tag>`` is missing
    (renamed back: it is the last complete copy of that tag)."""
    for p in save_dir.glob(".*.partial"):
        shutil.rmtree(p, ignore_errors=True)
    (save_dir / f".{LATEST}.tmp").unlink(missing_ok=True)
    for old in save_dir.glob(".*.old"):
        final = save_dir / old.name[1:-len(".old")]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        elif (old / MANIFEST).exists():
            old.rename(final)
    _fsync_dir(save_dir)


def _prepare(save_dir: Path, tag: str) -> None:
    save_dir.mkdir(parents=True, exist_ok=True)
    _repair(save_dir)
    (save_dir / f".{tag}.partial").mkdir()
    _fsync_dir(save_dir)


def _commit(save_dir: Path, tag: str, world: int, save_latest: bool, published: list,
            kind: int | None = None) -> None:
    partial, final, old = save_dir / f".{tag}.partial", save_dir / tag, save_dir / f".{tag}.old"
    files = {f.name: {"bytes": f.stat().st_size, "crc32": _crc32(f)}
             for f in sorted(partial.iterdir()) if f.name != MANIFEST}
    expected = _expected_files(world, kind)
    if set(files) != expected:
        raise CheckpointError(f"{partial}: expected files {sorted(expected)}, found {sorted(files)}")
    _write_durable(partial / MANIFEST, json.dumps(
        {"format": FORMAT, "tag": tag, "world": world, "complete": True, "deepspeed_layout": kind,
         "files": files}, indent=1))
    _fsync_dir(partial)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        _fsync_dir(save_dir)
    partial.rename(final)
    _fsync_dir(save_dir)
    published.append(True)
    if save_latest:
        tmp = save_dir / f".{LATEST}.tmp"
        _write_durable(tmp, tag)
        os.replace(tmp, save_dir / LATEST)
        _fsync_dir(save_dir)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(save_dir)


_PUBLISHED = f"'{LATEST}' was not updated"


def _settle(dp, tag: str, save_dir: Path, error: str | None) -> None:
    """Every rank learns whether any rank failed (this is also the barrier between the steps).
    On a failure rank 0 removes the half-written save, and every rank raises the same error."""
    if dp.world > 1:
        errors = [None] * dp.world
        torch.distributed.all_gather_object(errors, error, group=dp.group)
    else:
        errors = [error]
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if dp.rank == 0:
        _abandon(save_dir, tag)
    if any(_PUBLISHED in f for f in failed):
        raise CheckpointError(f"checkpoint {tag!r}: {'; '.join(failed)}")
    raise CheckpointError(f"checkpoint {tag!r} was not saved: {'; '.join(failed)}. The partial save "
                          f"was removed; the previous checkpoints and '{LATEST}' are as they were")


def _abandon(save_dir: Path, tag: str) -> None:
    """Remove a failed save's files; put the previous ``<tag>`` back if it was moved aside."""
    final, old = save_dir / tag, save_dir / f".{tag}.old"
    try:
        if not final.exists() and (old / MANIFEST).exists():
            old.rename(final)
        shutil.rmtree(save_dir / f".{tag}.partial", ignore_errors=True)
        _fsync_dir(save_dir)
    except OSError as e:        # the error being reported matters more
        log.warning("protrain: cleaning up the failed save of %s: %s", tag, e)


def _describe(e: BaseException, what: str, save_dir: Path) -> str:
    """What went wrong, with the OS error behind it (torch.save reports a failed write as
    "unexpected pos ..." and keeps the OSError only as the context)."""
    cause, seen = e, set()
    while cause is not None and not isinstance(cause, OSError) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError):
        where = f"{cause.filename}: " if cause.filename else ""
        msg = f"{what} failed: {where}{cause.strerror or cause}"
        if cause.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                free = fmt_bytes(shutil.disk_usage(save_dir).free)
            except OSError:
                free = "?"
            msg += f" - the disk (or quota) holding {save_dir} is full, {free} free"
        return msg
    return f"{what} failed: {type(e).__name__}: {e}"


def _save_durable(obj, path: Path) -> None:
    """torch.save, on the drive when it returns. Through a Python file so that a failed write
    raises the OSError (disk full) rather than only torch's "unexpected pos"."""
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except Exception as e:
        _name_file(e, path)
        raise


def _write_durable(path: Path, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except Exception as e:
        _name_file(e, path)
        raise


def _name_file(e: BaseException, path: Path) -> None:
    """Let the OSError behind ``e`` name the file it happened to."""
    for x in (e, e.__cause__, e.__context__):
        if isinstance(x, OSError) and x.filename is None:
            x.filename = str(path)


def _fsync_dir(path: Path) -> None:
    """Make the directory's entries (files created, renamed) survive a power loss."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:             # file systems without directory fsync
        pass
    finally:
        os.close(fd)


# ---- loading -------------------------------------------------------------------------------
def resolve(load_dir, tag=None) -> Path | None:
    """The directory to load: ``<tag>`` (from ``latest`` by default), or ``.<tag>.old`` when a
    save that replaced ``<tag>`` was killed between its two renames. None without ``latest``."""
    load_dir = Path(load_dir)
    if tag is None:
        latest = load_dir / LATEST
        if not latest.exists():
            return None
        tag = latest.read_text().strip()
        if not tag:
            raise CheckpointError(f"{latest} is empty: it should name the checkpoint to load (a tag "
                                  f"such as global_step100; it was written by another tool or "
                                  f"edited). Give the tag: load_checkpoint({str(load_dir)!r}, tag=...)")
    path = load_dir / str(tag)
    old = load_dir / f".{tag}.old"
    if not path.exists() and (old / MANIFEST).exists():
        log.warning("protrain: checkpoint %s: a save that replaced it was killed; loading the "
                    "previous copy %s (the next save puts it back)", path, old)
        return old
    return path


def _not_a_checkpoint(path: Path) -> CheckpointError:
    """Why ``path`` (a directory without a manifest) is not a usable ProTrain checkpoint."""
    names = sorted(p.name for p in path.iterdir())
    # ProTrain's own files first: its saves write DeepSpeed's files too.
    if META in names or any(n.startswith("protrain_states_rank") for n in names):
        return CheckpointError(f"checkpoint {path} is incomplete: {MANIFEST} is missing (the save "
                               f"was interrupted or the file deleted); load an earlier tag")
    deepspeed = [n for n in names if n.endswith(("_model_states.pt", "_optim_states.pt"))]
    if deepspeed:
        return CheckpointError(
            f"checkpoint {path} was written by DeepSpeed without ProTrain ({', '.join(deepspeed[:3])}): "
            f"its ZeRO optimizer states cannot be resumed by ProTrain's engine. To start from its "
            f"weights, load them into the model before deepspeed.initialize: model.load_state_dict("
            f"torch.load('{path / 'mp_rank_00_model_states.pt'}', weights_only=False)['module']) "
            f"(a ZeRO-3 checkpoint: run DeepSpeed's zero_to_fp32.py on it first)")
    if not names:
        return CheckpointError(f"checkpoint {path} is an empty directory, not a ProTrain checkpoint")
    return CheckpointError(f"{path} is not a ProTrain checkpoint: it has no {MANIFEST} and holds "
                           f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")


def verify(path: Path) -> dict:
    """The manifest of a complete, intact checkpoint directory, or CheckpointError."""
    if not path.is_dir():
        hint = ""
        if (path.parent / f".{path.name}.partial").exists():
            hint = f" (a save of it did not finish: .{path.name}.partial; the next save removes it)"
        raise CheckpointError(f"checkpoint {path} does not exist{hint}")
    manifest = path / MANIFEST
    if not manifest.exists():
        raise _not_a_checkpoint(path)
    try:
        info = json.loads(manifest.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt ({e})") from None
    if not isinstance(info, dict) or not info.get("complete") or info.get("format") != FORMAT:
        got = info if not isinstance(info, dict) else \
            f"format {info.get('format')}, complete={info.get('complete')}"
        raise CheckpointError(f"checkpoint {path}: not a complete ProTrain checkpoint ({got})")
    files, world = info.get("files"), info.get("world")
    if not isinstance(files, dict) or isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is malformed (world={world!r}, files "
                              f"{type(files).__name__}); it was edited or damaged")
    # The manifest vouches for the files it lists: it must list every file a checkpoint of its
    # world size has (an edited list would let an unchecked file in).
    # Older checkpoints: "zero_files" true for ZeRO-3's files, else none.
    kind = info.get("deepspeed_layout", 3 if info.get("zero_files") is True else None)
    if kind not in (None, 0, 2, 3):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is malformed (deepspeed_layout={kind!r}); "
                              f"it was edited or damaged")
    expected = _expected_files(world, kind)
    if set(files) != expected:
        missing, extra = sorted(expected - set(files)), sorted(set(files) - expected)
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} (world {world}) "
            + (f"does not list {missing}" if missing else "")
            + (" and " if missing and extra else "")
            + (f"lists unexpected files {extra}" if extra else "")
            + "; it was edited or damaged, so the files cannot be checked")
    for name in sorted(files):
        want = files[name]
        if not isinstance(want, dict) or not all(isinstance(want.get(k), int) for k in ("bytes", "crc32")):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} entry for {name} is malformed ({want!r})")
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


def _load_meta(path: Path, info: dict) -> dict:
    meta = torch.load(path / META, map_location="cpu", weights_only=False)
    if meta.get("world") != info["world"] or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {META} says world {meta.get('world')}, format "
                              f"{meta.get('format')}, the manifest world {info['world']}, format "
                              f"{FORMAT}; the checkpoint is inconsistent")
    return meta


def read_pieces(path: Path, world: int) -> dict[str, list[Piece]]:
    by_name: dict[str, list[Piece]] = defaultdict(list)
    for r in range(world):
        blob = torch.load(path / _states_file(r), map_location="cpu", weights_only=False, mmap=True)
        if blob.get("rank") != r or blob.get("world") != world:
            raise CheckpointError(f"checkpoint {path}: {_states_file(r)} holds rank {blob.get('rank')} "
                                  f"of {blob.get('world')}, expected rank {r} of {world}")
        for d in blob["pieces"]:
            by_name[d["name"]].append(Piece(**d))
    return by_name


def load(engine, load_dir, tag=None, *, load_optimizer_states=True, load_lr_scheduler_states=True,
         load_module_only=False):
    path = resolve(load_dir, tag)
    if path is None:
        return None, None
    info = verify(path)
    meta = _load_meta(path, info)
    have = _param_shapes(engine)
    want = meta["params"]
    frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
    if frozen & set(want):
        raise CheckpointError(f"checkpoint {path} trained parameters {sorted(frozen & set(want))[:3]}, "
                              f"which are frozen (requires_grad=False) in this run: resume with the "
                              f"same trainable parameters")
    parked = meta.get("parked", [])
    unfrozen = sorted(set(have) & (set(parked) | set(meta.get("extra_state") or {})
                                   | set(meta.get("frozen_excluded") or ())))
    if unfrozen:
        raise CheckpointError(f"checkpoint {path} was saved with parameters {unfrozen[:3]} frozen, "
                              f"which train (requires_grad=True) in this run: resume with the same "
                              f"trainable parameters (set requires_grad as it was at the save before "
                              f"loading, and change it after)")
    mismatch = [n for n in want if have.get(n) != want[n]] + sorted(set(have) - set(want))
    if mismatch:
        raise CheckpointError(f"checkpoint {path} was saved from another model: parameters "
                              f"{mismatch[:3]} differ")
    if engine.protrain_runtime is not None and engine.protrain_runtime.trainable_change() is not None:
        raise CheckpointError(f"load_checkpoint({str(load_dir)!r}) after requires_grad changed and "
                              f"before the forward that moves the states to the new trainable set: "
                              f"load first, then change requires_grad")
    pieces = read_pieces(path, info["world"])
    # Every rank's pieces: each rank cuts out what it holds; the step's gradients are dropped.
    states = load_optimizer_states and not load_module_only
    state = RuntimeState(pieces=[p for ps in pieces.values() for p in ps], local=False,
                         optimizer_states=states,
                         adam_chain=_chain(meta.get("adam_chain")) if states else None)

    flags = {n: p.requires_grad for n, p in engine.module.named_parameters()}

    def check() -> None:
        changed = sorted(n for n, p in engine.module.named_parameters() if p.requires_grad != flags.get(n))
        if changed:       # the states were checked against the flags at the load
            raise CheckpointError(
                f"requires_grad of {changed[:3]} changed between load_checkpoint({str(load_dir)!r}) "
                f"and the first forward, which takes the checkpoint's states: change it after the "
                f"first training step (or set it back)")

    def take() -> None:
        rt = engine.protrain_runtime
        rt.import_state(state)
        if states:
            engine._protrain_states.restore(pieces, parked, meta.get("step_counts", {}),
                                            rank0=rt.chunks.dp.rank == 0, half=rt.chunks.half)
    if engine.protrain_runtime is None:
        # Not planned yet: this job plans at its first forward as a fresh one does - its own
        # pins, plan_file, machine and batch, not the checkpoint's plan - and takes the states
        # then. The weights are the module's from now on (evaluation, generation, state_dict).
        _set_weights(engine.module, pieces, meta["params"])
        engine.protrain_resume_from(Resume(
            take=take, check=check,
            pieces=[p for ps in pieces.values() for p in ps] if states else None,
            meta={k: meta.get(k) for k in ("parked", "step_counts", "adam_chain")}))
    else:
        engine.protrain_runtime.optimizer.sync()
        take()
    engine._protrain_lost = None          # every state is the checkpoint's now
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
    dp = DataParallel()
    if info["world"] == dp.world:
        rng = torch.load(path / _states_file(dp.rank), map_location="cpu", weights_only=False,
                         mmap=True)["rng"]
        torch.random.set_rng_state(rng["cpu"])
        set_cuda_rng_states(rng.get("cuda"))
    return str(path), meta["client_state"]


_rng_devices_told = False


def set_cuda_rng_states(states) -> None:
    """Restore the CUDA RNG states saved by ``torch.cuda.get_rng_state_all()`` (one per device
    visible then) on the devices visible now: the first min(saved, visible). A job resumed with
    fewer GPUs visible (CUDA_VISIBLE_DEVICES narrowed, one GPU per rank) made
    ``set_rng_state_all`` fail on the first device that is not there. Nothing without CUDA."""
    global _rng_devices_told
    if not states or not torch.cuda.is_available():
        return
    visible = torch.cuda.device_count()
    if visible != len(states) and not _rng_devices_told:
        _rng_devices_told = True
        # Said once: the resumed run's random numbers (dropout) on a device may then differ
        # from those of an uninterrupted one.
        log.warning("protrain: the CUDA RNG states were saved for %d device(s) and %d are "
                    "visible; restoring those of the first %d", len(states), visible,
                    min(visible, len(states)))
    for i, state in enumerate(states[:visible]):
        torch.cuda.set_rng_state(state, i)


def _set_weights(module, pieces: dict[str, list[Piece]], shapes: dict[str, list[int]]) -> None:
    """Write the checkpoint's fp32 weights into ``module``'s trainable parameters (each rounded
    to the parameter's dtype, as the runtime rounds its masters)."""
    named = dict(module.named_parameters())
    with torch.no_grad():
        for name, shape in shapes.items():
            numel = 1
            for d in shape:
                numel *= d
            named[name].copy_(assemble(pieces, name, 0, numel)[0].view(shape))


def _chain(saved) -> tuple[int, int] | None:
    return tuple(saved) if saved is not None else None


def consolidated_state_dict(load_dir, tag=None) -> dict[str, torch.Tensor]:
    """fp32 weights of every trainable parameter, assembled from all ranks' pieces (for
    inference or for loading without ProTrain; tied parameters appear under their first name)."""
    path = resolve(load_dir, tag)
    if path is None:
        raise CheckpointError(f"{load_dir}: no 'latest' file; give the tag")
    info = verify(path)
    meta = _load_meta(path, info)
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


@dataclass
class Resume:
    """A checkpoint loaded before the first forward planned the runtime."""
    take: Callable[[], None]
    """Put the states into the runtime the first forward builds."""
    check: Callable[[], None]
    """Refuse what changed since the load (before planning)."""
    pieces: list[Piece] | None
    """Every rank's pieces of the checkpoint (None: its optimizer states were not loaded): what
    a save before the first forward writes (rank 0, as before any step)."""
    meta: dict
    """The checkpoint's parked parameters, FusedAdam counts and Adam chain, for that save."""


def _initial_pieces(engine, rank: int) -> list[Piece]:
    """The states before the first step (a save before the first forward, which DeepSpeed
    allows): each trainable parameter's value as its fp32 master, Adam's moments zero, step 0;
    written by rank 0 alone (every rank's pieces together cover each parameter once)."""
    if rank != 0:
        return []
    out = []
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            master = p.detach().float().cpu().reshape(-1).clone()
            out.append(Piece(name=name, lo=0, hi=master.numel(), master=master,
                             exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master),
                             step=0))
    return out


def _group_names(engine) -> list[list[str]]:
    """The trainable parameters' names per optimizer param group (empty groups left out), in
    the groups' order: ZeRO-2's flat groups."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    groups = [[names[id(p)] for p in g["params"] if p.requires_grad and id(p) in names]
              for g in engine.optimizer.param_groups]
    return [g for g in groups if g]


def _deepspeed_state(engine, world: int, client_state) -> dict:
    """What plain DeepSpeed's model file carries besides the module (its load_checkpoint
    reads these back)."""
    return {"lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "dp_world_size": world,
            "mp_world_size": 1, "ds_config": engine.config, "client_state": client_state or {}}


def _module_state(engine, excluded=()) -> tuple[list[str], dict]:
    """(the module's state_dict keys in order, ``_extra_state``)."""
    module = engine.module
    if engine.protrain_runtime is None:
        keys = list(module.state_dict(keep_vars=True))
    else:
        with engine.protrain_runtime.full_state.local():
            keys = list(module.state_dict(keep_vars=True))
    keys = [k for k in keys if k not in set(excluded)]
    return keys, _extra_state(engine, excluded)


def _extra_state(engine, excluded=()) -> dict:
    """What the module's state_dict holds besides trainable parameters (buffers, frozen
    parameters but the ``excluded`` ones). Rank 0 alone reads it: the sharded parameters,
    left out, are not gathered."""
    module = engine.module
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    if engine.protrain_runtime is None:         # not planned yet: plain tensors
        state = module.state_dict()
    else:
        with engine.protrain_runtime.full_state.local():
            state = module.state_dict()
    skip = trainable | set(excluded)
    return {k: v.detach().cpu().clone() for k, v in state.items() if k not in skip}


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

"""Exact JSON round trips for the frozen dataclasses the planner passes around.

Profiles and plans are values: saved, loaded, compared. ``to_jsonable`` turns a dataclass tree
into plain JSON types; ``from_jsonable`` rebuilds it from the field type hints, so a loaded
value compares equal to the saved one (floats survive because json writes repr()).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import secrets
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


def from_jsonable(tp: Any, data: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if data is None:
            return None
        return from_jsonable(args[0], data)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_jsonable(args[0], x) for x in data)
        return tuple(from_jsonable(a, x) for a, x in zip(args, data))
    if origin is dict:
        _, vt = typing.get_args(tp)
        return {k: from_jsonable(vt, v) for k, v in data.items()}
    if origin is typing.Literal:
        return data
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(data)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        kwargs = {f.name: from_jsonable(hints[f.name], data[f.name])
                  for f in dataclasses.fields(tp) if f.name in data}
        return tp(**kwargs)
    if tp is float and isinstance(data, int):
        return float(data)
    return data


def dump_json(obj: Any, path: str | Path) -> None:
    """Write atomically: a crash or a power loss mid-write never leaves a truncated file
    behind (the new text is on the drive before it replaces the old). Each write goes through
    a temporary file of its own (process id and a random part in the name, in the same
    directory so the rename stays on one file system): two jobs writing one plan or cache file
    at once both succeed, and the file holds the last complete write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(to_jsonable(obj), indent=1) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    # O_EXCL: never someone else's file; mode 0o666 less the umask, as open() would give
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def unwritable(directory: str | Path) -> str | None:
    """Why files cannot be written in ``directory`` (created if missing), or None when they
    can. Tried for real: permission bits say nothing about read-only mounts or root."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return f"{d} exists and is not a directory"
    except OSError as e:
        return f"cannot create {d}: {e.strerror or e}"
    if not d.is_dir():
        return f"{d} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=d, prefix=".protrain-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot create files in {d}: {e.strerror or e}"
    return None


def load_json(tp: type[T], path: str | Path) -> T:
    return from_jsonable(tp, json.loads(Path(path).read_text(encoding="utf-8")))


class JsonValue:
    """Mixin for frozen dataclasses saved as JSON: to_dict / from_dict / save / load."""

    __slots__ = ()

    def to_dict(self) -> dict:
        return to_jsonable(self)

    @classmethod
    def from_dict(cls: type[T], data: dict) -> T:
        return from_jsonable(cls, data)

    def save(self, path: str | Path) -> None:
        dump_json(self, path)

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        return load_json(cls, path)

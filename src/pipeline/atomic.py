"""Every output is written here: through a temporary file and a rename, so a killed job never
leaves a truncated file that looks complete, and a failed write (a full disk, say) ends in one
OutputError that names the file, the free space there and what is intact. Each command asks
here first, before any work, whether its output places can be written at all."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson

from pipeline.errors import OutputError


def write_with(
    path: str | Path, write: Callable[[Path], None], advice: str = "", *, durable: bool = True
) -> Path:
    """Call `write(tmp)` on a temporary file beside `path`, then rename it into place.

    A failed write becomes an OutputError ending with `advice` (what else the caller keeps, and
    how to go on), provided `write` lets its OSError through, if only as the context of its own
    exception: torch.save into a Python file object does, torch.save into a path does not.
    `durable=False` leaves out the fsync before the rename, for many files that `sync` flushes
    together (one wait for the disk instead of one per file): a killed process still never
    leaves a half-written file under `path`, but until `sync` a crash of the machine may.
    """
    path = Path(path)
    kept = (
        f"The previous {path.name} is unchanged." if path.exists() else "No partial file is left."
    )
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError as error:  # a file where a folder should be
            raise NotADirectoryError(
                errno.ENOTDIR, os.strerror(errno.ENOTDIR), error.filename
            ) from error
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        # Exclusive create like mkstemp, but with mode 0o666 so the umask applies: mkstemp's
        # 0600 would leave every output unreadable to the group, e.g. on a shared cluster.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        try:
            write(tmp)
            if durable:
                with open(tmp, "rb+") as handle:
                    os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
    except Exception as error:
        cause = _os_error(error)
        if cause is None:
            raise
        raise _write_failed(path, cause, kept, advice) from error
    return path


def sync(paths: Iterable[Path]) -> None:
    """Flush files written with `durable=False` to disk: with one system-wide sync where the OS
    has it (it waits for the writes on Linux), else one fsync per file."""
    if hasattr(os, "sync"):
        os.sync()
        return
    for path in paths:
        with open(path, "rb+") as handle:
            os.fsync(handle.fileno())


def _os_error(error: BaseException | None) -> OSError | None:
    """The OSError behind `error`: itself, or the one a library caught and replaced."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def append_line(path: str | Path, line: str, advice: str = "") -> None:
    """Append `line` and a newline to a log such as metrics.jsonl. A failed write cuts the file
    back to where it ended, so it never ends in half a line, and raises OutputError."""
    path = Path(path)
    data = (line + "\n").encode("utf-8")
    try:
        with open(path, "ab", buffering=0) as handle:  # unbuffered: no bytes left to flush later
            end = handle.seek(0, os.SEEK_END)
            try:
                written = 0
                while written < len(data):  # a write may take only part of the bytes
                    written += handle.write(data[written:])
            except OSError:
                handle.truncate(end)
                raise
    except OSError as error:
        kept = f"{path.name} keeps the lines written before."
        raise _write_failed(path, error, kept, advice) from error


def make_folder(path: str | Path, option: str = "") -> Path:
    """`path` and the folders above it, where they are missing; a file in the way, a read-only
    mount, no permission or a full disk end in one OutputError naming the folder (and the
    `option` that named it), as a failed write does, never in a traceback."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:  # a file holds a folder's name
        raise _file_in_the_way(path, option) from error
    except OSError as error:
        raise _write_failed(path, error, "Nothing was written.", folder=True) from error
    return path


def refuse_unwritable_output(
    option: str, path: str | Path | None, *, folder: bool = False, advice: str = ""
) -> None:
    """Refuse, before any work, an output place that writing would fail on only once the work
    is done (after a whole evaluation or training): a file where a folder must be, a folder
    where the file `option` names must be (not with `folder`), or a folder this user may not
    write in (a read-only results folder or mount). Nothing is created: a command that fails
    later for another reason leaves no empty folder. `advice` ends the message of a folder
    named as the file. None: the option was not given."""
    if not path:
        return
    path = Path(path)
    target = path if folder else path.parent
    if not folder and os.path.isdir(path):
        raise OutputError(
            f"{option} {path} is a folder: give {option} the path of a file to write (in that "
            "folder, say). Nothing was written." + (f" {advice}" if advice else "")
        )
    # os.path's tests: a folder this user may not search is a place that is not there
    nearest = next(place for place in (target, *target.parents) if os.path.exists(place))
    if not os.path.isdir(nearest):
        raise _file_in_the_way(target, option, None if folder else path)
    if not os.access(nearest, os.W_OK | os.X_OK):
        read_only = hasattr(os, "statvfs") and bool(os.statvfs(nearest).f_flag & os.ST_RDONLY)
        why = "is on a read-only file system" if read_only else "is not writable by this user"
        what = f"into the folder {path}" if folder else path
        raise OutputError(
            f"Could not write {what} ({option}): the folder {nearest} {why}. Nothing was "
            f"written. Give {option} a path in a folder that can be written."
        )


def _file_in_the_way(folder: Path, option: str, file: Path | None = None) -> OutputError:
    """The message of a folder that cannot be made because a file holds its name or a name
    above it: the file, left as it was; the `option` that named the folder, or the `file` to
    be written in it."""
    blocker = next(place for place in (folder, *folder.parents) if os.path.exists(place))
    named = f" for {option} {file}" if file else f" ({option})" if option else ""
    instead = f"give {option} a path elsewhere" if option else "write elsewhere"
    return OutputError(
        f"Could not create the folder {folder}{named}: {blocker} is a file, not a folder. "
        f"Nothing was written. Move that file away, or {instead}."
    )


def _write_failed(
    path: Path, error: OSError, kept: str, advice: str = "", *, folder: bool = False
) -> OutputError:
    """The one message of a failed write: the file (or `folder`), why, the free space there,
    what is intact."""
    code = errno.errorcode.get(error.errno or 0)
    culprit = Path(error.filename) if error.filename else None
    if code and culprit and culprit.parent != path.parent:  # a folder on the way, say
        code = f"{code}: {culprit}"
    reason = f"{error.strerror} ({code})" if error.strerror and code else str(error)
    action = "create the folder" if folder else "write"
    parts = [f"Could not {action} {path}: {reason}{_free_space(path.parent)}.", kept]
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        parts.append("Free some space (or write elsewhere) and run again.")
    if advice:
        parts.append(advice)
    return OutputError(" ".join(parts))


def _free_space(folder: Path) -> str:
    """', with 1.2 MiB free on the file system of FOLDER', or '' where that cannot be read."""
    while not folder.is_dir() and folder != folder.parent:  # the nearest folder that exists
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return f", with {_size(free)} free on the file system of {folder}"


def _size(count: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def write_bytes(path: str | Path, data: bytes) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            handle.write(data)

    return write_with(path, write)


def write_text(path: str | Path, text: str) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)

    return write_with(path, write)


def jsonable(value: Any) -> Any:
    """Non-finite floats become null: JSON has no NaN, and a reader must not choke on one."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    if getattr(value, "ndim", 0) > 0 and callable(getattr(value, "tolist", None)):  # arrays
        return jsonable(value.tolist())
    if hasattr(value, "item") and callable(value.item):  # numpy and torch scalars
        return jsonable(value.item())
    return value


# A list of numbers as an indenting encoder writes it: one number per line. Only indentation
# puts a raw newline in JSON text (strings escape theirs), so this never matches inside a string.
_INDENTED_NUMBERS = re.compile(rb"\[\n[-+0-9.eE,\s]*\n\s*\]")


def _one_line(numbers: re.Match[bytes]) -> bytes:
    return b"[" + b" ".join(numbers.group(0)[1:-1].split()) + b"]"


_ORJSON_INDENTS = {None: 0, 2: orjson.OPT_INDENT_2}


def write_json(
    path: str | Path, data: Any, *, indent: int | None = 2, numpy_arrays: bool = False
) -> Path:
    """Indented for people to read, with each list of numbers on one line (a step-time list or
    an eval JSON's per-image counts would take a line per number); `indent=None` writes one
    compact line (large files: a predictions file's numbers). Encoded by orjson, many times
    faster than json's encoder (whose indenting one is pure Python), to the same JSON: each
    float its shortest round-trip digits, as Python's repr (below 1e-4 without an exponent,
    which JSON allows); non-ASCII as UTF-8, not escaped; NaN and infinities as null. Data
    beyond JSON's own types (numpy scalars, paths, int keys, integers past 64 bits) is made
    JSON's first (`jsonable`) and goes through json's encoder, as do other indents.
    `numpy_arrays`: `data` holds C-contiguous float64 or integer numpy arrays, which orjson
    writes as the lists they hold without making a Python number of each (most of the time a
    predictions file's numbers took as lists); off, numpy scalars stay `jsonable`'s (orjson
    would write a float32 one with float32's shortest digits)."""
    text = None
    if indent in _ORJSON_INDENTS:
        try:  # JSON's own types throughout: as they are
            option = _ORJSON_INDENTS[indent] | orjson.OPT_APPEND_NEWLINE
            if numpy_arrays:
                option |= orjson.OPT_SERIALIZE_NUMPY
            text = orjson.dumps(data, option=option)
        except TypeError:  # json's way below
            pass
    if text is None:
        separators = None if indent is not None else (",", ":")
        encoded = json.dumps(jsonable(data), indent=indent, separators=separators, allow_nan=False)
        text = (encoded + "\n").encode("utf-8")
    if indent is not None:
        text = _INDENTED_NUMBERS.sub(_one_line, text)
    return write_bytes(path, text)

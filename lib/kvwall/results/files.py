"""Reading and writing a result file's bytes: only plain files, of bounded size and depth, replaced atomically.

:func:`read_json` reads only a plain file (never a symbolic link, folder, named pipe or device: the type is checked
before opening, and the file is opened non-blocking and checked again), of at most :data:`MAX_FILE_BYTES`, of UTF-8
JSON nested at most :data:`MAX_DEPTH` deep and without duplicate keys: anything else is a
:class:`~kvwall.results.errors.ResultFileError` naming the file, never a hang, a RecursionError or a read of a
device. Symbolic links are refused, not followed: a result file is a plain file in its folder (a link could lead to
a device, a pipe or a file outside it, and writing would replace the link, not what it points to).
:func:`check_writable_target` says before a measurement whether its result could be written;
:func:`write_atomically` replaces a file through an fsynced temporary file and a rename.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

from kvwall.results.errors import ResultFileError, ResultMissingError, ResultTargetError, shown

__all__ = ["MAX_FILE_BYTES", "MAX_DEPTH", "check_writable_target", "read_json", "too_deep", "write_atomically"]

#: The largest result file the store reads or writes: 8 MiB (the largest recorded one is about 0.4 MB).
MAX_FILE_BYTES = 8 * 1024 * 1024
#: How deeply a result file's JSON may nest (objects and arrays; the recorded ones nest at most 5 deep).
MAX_DEPTH = 64


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def _not_plain(mode: int) -> str | None:
    """Why a file of ``mode`` (from lstat) is not read or replaced as a result file; None for a plain file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return (
            "is a symbolic link: result files are read and written only as plain files in their folder (a link "
            "could lead anywhere: a device, a pipe, a file outside it); put the file itself there"
        )
    return f"is {_kind(mode)}, not a plain file: move it out of the way"


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\[\s\S]?)*+"?|[\[\]{}]')


def too_deep(text: str) -> bool:
    """Whether the JSON ``text`` nests more than :data:`MAX_DEPTH` deep (one linear pass; strings skipped)."""
    depth = 0
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif token in "]}":
            depth -= 1
    return False


class _DuplicateKey(ValueError):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def _parse(path: Path, raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ResultFileError(path, f"not UTF-8 text (byte {exc.start}); not a result file") from None
    if too_deep(text):
        raise ResultFileError(
            path,
            f"its JSON nests more than {MAX_DEPTH} levels deep (result files nest a few levels); not a result file",
        )
    try:
        return json.loads(text, object_pairs_hook=_object)
    except _DuplicateKey as exc:
        raise ResultFileError(
            path,
            f"the key {shown(str(exc))} appears twice in one JSON object (edited by hand? "
            "which one counts is up to the reader, so neither is believed)",
        ) from None
    except (ValueError, RecursionError) as exc:
        raise ResultFileError(path, f"not valid JSON ({exc}); truncated?") from None


def read_json(path: Path) -> Any:
    """The JSON value of the result file ``path``, read safely: refused (:class:`ResultFileError` naming the file)
    unless it is a plain file (no link, folder, pipe or device: checked before opening, opened non-blocking and
    checked again) of at most :data:`MAX_FILE_BYTES`, UTF-8 JSON nested at most :data:`MAX_DEPTH` deep, with no
    duplicate keys; :class:`ResultMissingError` if there is no file at all."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise ResultMissingError(path, "no such result file") from None
    except OSError as exc:
        raise ResultFileError(path, f"cannot be examined ({exc.strerror or exc})") from None
    problem = _not_plain(mode)
    if problem:
        raise ResultFileError(path, problem)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ResultMissingError(path, "no such result file") from None
    except OSError as exc:
        raise ResultFileError(path, f"cannot be read ({exc.strerror or exc}); check its permissions") from None
    try:
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(file.fileno())
            problem = _not_plain(info.st_mode)  # replaced between the look and the open
            if problem:
                raise ResultFileError(path, problem)
            if info.st_size > MAX_FILE_BYTES:
                raise ResultFileError(
                    path,
                    f"is {info.st_size:,} bytes, more than the {MAX_FILE_BYTES:,} bytes a "
                    "result file may have; not a result file",
                )
            raw = file.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ResultFileError(path, f"cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ResultFileError(
            path,
            f"is more than the {MAX_FILE_BYTES:,} bytes a result file may have (it grew "
            "while being read); not a result file",
        )
    return _parse(path, raw)


def check_writable_target(path: Path) -> None:
    """Raise :class:`ResultTargetError` if a result file could not be written at ``path`` (checked without writing
    anything): something other than a plain file is there (a folder, a named pipe, a device, a symbolic link), or its
    folder exists and this user cannot write in it. A missing folder passes (``record`` creates it). Run it before
    measuring, so a run is not wasted; :func:`save_result` checks again before it writes."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise ResultTargetError(path, f"cannot be examined ({exc.strerror or exc})") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise ResultTargetError(
            path,
            "is a symbolic link (a result is written only as a plain file, and replacing the link would drop it)"
            if stat.S_ISLNK(mode)
            else f"is {_kind(mode)}: a result file cannot replace it",
        )
    folder = path.parent
    if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
        raise ResultTargetError(path, f"its folder {folder} is not writable by this user")


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder, flushed to disk, and a rename: a reader
    sees the old file or the new one, never half of one, and a writer killed before the rename leaves the old file
    (and at worst a ``.<name>.*.tmp`` beside it). The file gets the mode a plain ``open()`` would (0666 less the
    umask)."""
    umask = os.umask(0)
    os.umask(umask)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False) as tmp:
        tmp_path = Path(tmp.name)
        try:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())
            os.chmod(tmp_path, 0o666 & ~umask)
        except BaseException:
            tmp.close()
            tmp_path.unlink()
            raise
    try:
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    try:  # the rename itself, on disk
        folder = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)

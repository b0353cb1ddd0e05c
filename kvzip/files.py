"""Output files: checked before the work that fills them, then published atomically.

A command that runs for minutes (a batch, a training, a bench) must not find out at the end that its output path
is a directory or sits in a folder it may not write, and a reader must never see a half-written file. So:
`check_writable(path)` probes the target before any model work (UserError, one line, in terms of the path, not of a
command-line flag), and every writer goes through `atomic_path` / `write_atomic`: the data goes to a temporary file
beside the target, is flushed to disk, and is renamed over the target only once complete. An error or Ctrl-C while
writing leaves neither a partial target nor the temporary file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvzip.errors import UserError


def check_writable(path: str | os.PathLike) -> Path:
    """`path` as a Path once it is known that a file can be published there; UserError otherwise.

    Refused: an existing directory, a missing parent folder, a parent that is not a folder, and a parent where this
    process cannot create a file (read-only, no permission; probed by creating and removing a temporary file, since
    permission bits say nothing for root or a read-only mount)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a directory: give a file path")
    parent = path.parent
    if not parent.exists():
        raise UserError(f"cannot write {path}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise UserError(f"cannot write {path}: {parent} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".probe")
    except OSError as exc:
        raise UserError(f"cannot write {path}: no file can be created in {parent} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)
    return path


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Give `tmp` the permissions a plain `open()` would have (mkstemp makes it 0600), then rename it to `path`."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary file name beside `path` for a writer that wants a file name (a plot, a safetensors save). When
    the block ends normally the file is synced and renamed to `path`; on any exception it is removed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        publish(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` so that a reader sees either the old file or the whole new one."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)

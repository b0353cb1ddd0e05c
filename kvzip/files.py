"""Atomic publication of a file written under a temporary name."""

from __future__ import annotations

import os


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Give `tmp` the permissions a plain `open()` would have (mkstemp makes it 0600), then rename it to `path`."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)

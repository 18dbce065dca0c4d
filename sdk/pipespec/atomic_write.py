"""Writing a file whole or not at all: a temp file in the same directory, then ``os.replace``.

A failure leaves the original byte-identical, and readers see the old file or the new one. Used by
``adapter-gen``, the zoo reports and the scaffold, and by the vLLM integration's cache of
adapted modules; standard library only, imports nothing of pipespec but its errors.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pipespec.errors import PipespecError, UsageError

__all__ = ["write_atomic"]


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same directory and ``os.replace``.

    Readers see the old file or the new one, never a half-written one; on any failure the temp file
    is removed and an existing ``path`` is left byte-identical. An existing file's permissions are kept.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise UsageError(f"{path}: directory {directory} does not exist; create it or choose another --out path")
    existed = path.exists()
    if existed:
        mode = path.stat().st_mode & 0o7777
    else:  # what open() would have created: 0o666 less the umask (mkstemp makes 0o600)
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise PipespecError(f"{path}: cannot write there ({exc.strerror or exc}); nothing was changed") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise PipespecError(f"{path}: writing failed ({exc.strerror or exc}); "
                                f"{'the file is unchanged' if existed else 'nothing was written'}") from None
        raise

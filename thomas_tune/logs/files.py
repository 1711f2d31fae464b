"""Files of a tuning-log folder written whole: a new file renamed over the old one."""

from __future__ import annotations

import os
import tempfile

from ..models import share_mode


def rewrite_atomically(path: str, lines: list[str]) -> None:
    """Replace the file ``path`` by ``lines`` (strings with their newlines): written to a
    temporary file in the same folder, flushed to disk, then renamed over ``path``, so a
    reader, or a run killed meanwhile, sees the old file or the new one, never half of one.
    The new file gets the folder's sharing mode (:func:`thomas_tune.models.share_mode`)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    share_mode(tmp)
    os.replace(tmp, path)

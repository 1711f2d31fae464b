"""Files written whole: made under a temporary name in their folder, then renamed over the old one.

The files the product writes whole (a tuning log's files rewritten after a check, merge or
re-measure, its stamps and hashes, exports, checkpoints, the built OpenCL runtime, caches) go
through :func:`replacing`, so a reader, or a run killed meanwhile, sees the old file or the new
one, never half of one. The rename is atomic because the temporary file sits in the same folder
(POSIX ``rename(2)``). Files that grow by appended lines (MetaSchedule's records, failed
trials) are not rewritten.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator


def share_mode(path: str, executable: bool = False) -> None:
    """Give a file made by ``tempfile.mkstemp`` (mode 0600) the mode a plain ``open`` (or a
    linker, for ``executable``) would: 0666 (0777) less the umask, so that checkpoints and
    exports stay readable by their users."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if executable else 0o666) & ~mask)


@contextlib.contextmanager
def replacing(path: str, executable: bool = False, sync: bool = True) -> Iterator[str]:
    """Yield a temporary path beside ``path`` (same folder, same extension, which some
    writers need: TVM's ``export_library`` picks the linker by it) for the caller to write;
    when the block ends normally, the file gets :func:`share_mode` (``executable`` for
    shared libraries), is flushed to disk (``sync``; caches that are made again when lost
    pass False) and renamed over ``path``. When the block raises, the temporary file is
    removed and ``path`` is left as it was. The folder is made when missing."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1], dir=folder)
    os.close(fd)
    try:
        yield tmp
        if sync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        share_mode(tmp, executable=executable)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_atomically(path: str, data: str | bytes | list[str], sync: bool = True) -> None:
    """Replace the file ``path`` by ``data``: text, bytes, or lines (strings with their
    newlines), through :func:`replacing`."""
    if isinstance(data, list):
        data = "".join(data)
    mode = "wb" if isinstance(data, bytes) else "w"
    with replacing(path, sync=sync) as tmp, open(tmp, mode) as f:
        f.write(data)


def write_json_atomically(path: str, obj, indent: int | None = 1, sync: bool = True) -> None:
    """Replace the file ``path`` by ``obj`` as JSON (``json.dump`` with ``indent``), through
    :func:`replacing`. Raises TypeError when ``obj`` is not JSON-serialisable (``path`` is
    then left as it was)."""
    with replacing(path, sync=sync) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)


def read_json(path: str, failure: str):
    """The JSON value in file ``path``. Raises ValueError with ``failure`` (a message naming
    the file and the fix, where the text ``{err}`` stands for the reason) when the file cannot
    be read or parsed."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(failure.replace("{err}", str(err))) from err

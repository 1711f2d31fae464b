"""The one atomic-write helper: a file is replaced whole or left as it was."""

import json
import os
import stat

import pytest

from thomas_tune.files import replacing, write_atomically, write_json_atomically

# the whole file runs in seconds: all of it in the subset for edits (pytest -m quick)
pytestmark = pytest.mark.quick


def test_replaced_whole_with_a_plain_files_mode(tmp_path):
    path = tmp_path / "sub" / "log.json"  # the folder is made
    write_atomically(str(path), ["a\n", "b\n"])
    assert path.read_text() == "a\nb\n"
    write_json_atomically(str(path), {"x": [1, 2]})
    assert json.loads(path.read_text()) == {"x": [1, 2]}
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    write_atomically(str(path), b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert os.listdir(path.parent) == ["log.json"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "records.json"
    path.write_text("old\n")
    with pytest.raises(TypeError):
        write_json_atomically(str(path), {"not json": object()})
    with pytest.raises(RuntimeError), replacing(str(path)) as tmp:
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("killed meanwhile")
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["records.json"]


def test_a_library_keeps_its_extension_and_is_executable(tmp_path):
    path = tmp_path / "train.so"
    with replacing(str(path), executable=True) as tmp:
        assert tmp.endswith(".so") and os.path.dirname(tmp) == str(tmp_path)
        with open(tmp, "wb") as f:
            f.write(b"\x7fELF")
    assert os.access(path, os.X_OK)

"""The suite's one skip guard (tests/conftest.py): with THOMAS_TUNE_NO_SKIP set, as in CI, a
skip of any kind fails."""

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))

SKIPS = {
    "test_skip_at_import.py": "import pytest\npytest.importorskip('no_such_module_here')\n\n"
                              "def test_a():\n    pass\n",
    "test_skip_mark.py": "import pytest\n\n@pytest.mark.skipif(True, reason='no device')\n"
                         "def test_b():\n    pass\n",
    "test_skip_call.py": "import pytest\n\ndef test_c():\n    pytest.skip('no device')\n",
}


def _pytest(folder, no_skip: bool):
    env = {k: v for k, v in os.environ.items() if k != "THOMAS_TUNE_NO_SKIP"}
    if no_skip:
        env["THOMAS_TUNE_NO_SKIP"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([TESTS, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "conftest", "-p", "no:xdist", "-rfE",
                           "--continue-on-collection-errors", str(folder)],
                          capture_output=True, text=True, cwd=folder, env=env, timeout=300)


def test_every_kind_of_skip_fails_where_the_suite_allows_none(tmp_path):
    for name, text in SKIPS.items():
        (tmp_path / name).write_text(text)
    allowed = _pytest(tmp_path, no_skip=False)
    assert allowed.returncode == 0 and "3 skipped" in allowed.stdout, allowed.stdout
    strict = _pytest(tmp_path, no_skip=True)
    out = strict.stdout + strict.stderr
    assert strict.returncode != 0, out
    assert "skipped" not in out.splitlines()[-1], out
    for what in ("no_such_module_here", "test_b", "test_c"):
        assert what in out, (what, out)
    assert out.count("a skip is a failure") >= 3, out

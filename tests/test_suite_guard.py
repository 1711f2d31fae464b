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



# A plugin for the collection below: it prints the declared markers and each collected test
# with the names of all its marks (module, class and parameter marks included), tab-separated.
MARKS_PLUGIN = """
def pytest_collection_finish(session):
    for line in session.config.getini("markers"):
        print("MARKER\t" + line.split(":")[0].strip())
    for item in session.items:
        print("TEST\t" + item.nodeid + "\t" + ",".join(m.name for m in item.iter_markers()))
"""


def test_the_quick_subset_is_declared_and_holds_no_tvm_rpc_test(tmp_path):
    """`pytest -m quick` (README: the subset for edits) collects tests, its marker is declared in
    setup.cfg (--strict-markers makes an undeclared one an error), and none of its tests is
    marked tvm_rpc (those start TVM's C++ server: the whole suite runs them, quick never)."""
    (tmp_path / "quick_marks.py").write_text(MARKS_PLUGIN)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), TESTS, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "-p", "quick_marks", "-p", "no:xdist",
                          "--strict-markers", "-m", "quick", TESTS],
                         capture_output=True, text=True, cwd=os.path.dirname(TESTS), env=env,
                         timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    rows = [line.split("\t") for line in run.stdout.splitlines()]
    assert {"quick", "tvm_rpc"} <= {row[1] for row in rows if row[0] == "MARKER"}, out
    tests = {row[1]: row[2].split(",") for row in rows if row[0] == "TEST"}
    assert len(tests) >= 10 and all("quick" in marks for marks in tests.values()), out
    remote = [nodeid for nodeid, marks in tests.items() if "tvm_rpc" in marks]
    assert not remote, f"tests marked tvm_rpc in the quick subset: {remote}"

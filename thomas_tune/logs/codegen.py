"""The code-generation version a tuning log's times belong to, stamped in the log folder.

A record's time is the time of the kernel that its trace made when it was measured. The same
trace makes other code when what turns a trace into a kernel changes, so a time is only
trusted with the code generation it was measured with. That is, for the OpenCL kernels tuned
here (each part a *component* of the version):

* ``tvm``: the pinned TVM (``tvm.__version__``): scheduling primitives, lowering, OpenCL codegen;
* ``schedules``: the schedule rules, sketches, postprocessors and custom instructions of
  ``schedules/`` (every module there);
* ``opencl_source``: the rewrite of TVM's OpenCL C before it reaches the device
  (``thomas_tune/opencl_source.py``);
* ``builder``: how a candidate is built (``thomas_tune/measure/builder.py``).

Each source component is a fingerprint of its modules' code: the sha256 of their syntax trees
with docstrings left out, written back as source (``ast.unparse``: comments and layout never
reach it), so a wording change keeps the version and any change of code makes a new one (a
conservative fingerprint: a change of code that leaves every kernel as it was makes a new
version too). The text ``ast.unparse`` writes is the same from Python 3.11 to 3.13, where
``ast.dump``'s changes with the node classes of each release: a log tuned on a machine with
another Python (the GPU machine's 3.12) keeps its version here. The version's ``id`` is the first
12 hex digits of the sha256 of the components.

The stamp is ``codegen.json`` in the log folder (:data:`STAMP`): the version that *every*
record of the folder was measured with. It is written when a run starts measuring into a
folder with no records (``tune``, ``remeasure --restamp``), or rewritten for a new version
whose kernels are byte-identical to the stamped one's for every record (``log carry``,
:mod:`.carry`); a folder without it (every log made before stamps, or by another tool) is of
*unknown* version. The device's own OpenCL
compiler (its driver and ``THOMAS_TUNE_OPENCL_OPTIONS``) belongs to the device, not to the
stamp; the default-schedule times of ``default_latency.json`` carry their own check
(:func:`thomas_tune.tuning.defaults.defaults_stamp` and one key per timed kernel).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import os
import time
from dataclasses import dataclass, field

from ..files import write_atomically

STAMP = "codegen.json"


def _fingerprint(paths: list[str]) -> str:
    """sha256 (first 12 hex digits) of the syntax trees of the Python files ``paths`` (sorted
    by file name), docstrings removed, as ``ast.unparse`` writes them."""
    h = hashlib.sha256()
    for path in sorted(paths, key=os.path.basename):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        h.update(os.path.basename(path).encode() + b"\0")
        h.update(ast.unparse(tree).encode())
    return h.hexdigest()[:12]


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)  # imports the parent package only
    return list(spec.submodule_search_locations)[0]


@functools.cache
def current() -> dict:
    """This installation's code-generation version: ``{"id": str, "components": {name: str}}``
    (see the module docstring for the components)."""
    import tvm
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # thomas_tune/
    schedules = _package_dir("thomas_tune.schedules")
    components = {
        "tvm": tvm.__version__,
        "schedules": _fingerprint([os.path.join(schedules, n) for n in os.listdir(schedules)
                                   if n.endswith(".py")]),
        "opencl_source": _fingerprint([os.path.join(here, "opencl_source.py")]),
        "builder": _fingerprint([os.path.join(here, "measure", "builder.py")]),
    }
    return {"id": version_id(components), "components": components}


def version_id(components: dict) -> str:
    """The id of a version made of ``components`` (12 hex digits of a sha256)."""
    text = json.dumps(components, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass
class LogVersion:
    """What a log folder's stamp says against this installation: ``status`` is "current",
    "other" (stamped with another version; ``differs``: the components that differ) or
    "unknown" (no stamp, or one that does not parse: ``why``); ``stamp`` the stamp as read."""

    status: str
    stamp: dict | None = None
    differs: list[str] = field(default_factory=list)
    why: str = ""

    def line(self) -> str:
        """One line for a report."""
        now = current()
        if self.status == "current":
            return f"code generation {now['id']} (this installation's)"
        if self.status == "other":
            parts = ", ".join(self.differs) or "id"
            return (f"code generation {self.stamp.get('id')}, not this installation's "
                    f"{now['id']} (differs in: {parts})")
        return f"code generation unknown ({self.why}); this installation's is {now['id']}"


def read_version(path: str) -> LogVersion:
    """The stamp of the log folder ``path`` against :func:`current` (never raises for a bad
    or missing stamp: that is an unknown version)."""
    stamp_path = os.path.join(path, STAMP)
    if not os.path.exists(stamp_path):
        return LogVersion("unknown", why=f"no {STAMP}: measured before logs were stamped, or "
                          "by another tool")
    try:
        with open(stamp_path) as f:
            stamp = json.load(f)
        components = dict(stamp["components"])
        stamped_id = str(stamp["id"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return LogVersion("unknown", why=f"{STAMP} does not parse: {err}")
    now = current()
    if stamped_id == now["id"] and version_id(components) == stamped_id:
        return LogVersion("current", stamp)
    differs = sorted(k for k in set(components) | set(now["components"])
                     if components.get(k) != now["components"].get(k))
    return LogVersion("other", stamp, differs)


def write_stamp(path: str, how: str, stamp: dict | None = None,
                carried_from: dict | None = None) -> None:
    """Stamp the log folder ``path`` (atomically) with ``stamp`` (default: :func:`current`);
    ``how`` says what measured its records (kept in the stamp for people); ``carried_from``:
    the stamp it replaces, for a log carried over to this version (:mod:`.carry`), kept in it
    as ``"carried_from"`` (what measured the records, and when)."""
    body = dict(stamp or current())
    body = {"id": body["id"], "components": body["components"], "how": how,
            "stamped": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if carried_from is not None:
        body["carried_from"] = carried_from
    os.makedirs(path, exist_ok=True)
    write_atomically(os.path.join(path, STAMP), json.dumps(body, indent=1) + "\n")


class CodegenMismatch(ValueError):
    """A tuning log's times belong to another (or an unknown) code generation; the message
    names the ways to re-measure them."""


def mismatch(log_path: str, version: LogVersion, action: str) -> CodegenMismatch:
    """The error refusing ``action`` (e.g. "tune into it") on the log ``log_path`` whose
    version is ``version``, naming the fixes."""
    return CodegenMismatch(
        f"tuning log {log_path!r}: {version.line()}; its times are not trusted, so it is not "
        f"used to {action}. Re-measure its records on the device first: "
        f"'thomas-tune remeasure --restamp --log {log_path} ...' (the best records of each "
        f"workload timed again in place, the others set aside, the log stamped), or seed a "
        f"new log from it with 'thomas-tune tune --seed-log {log_path} --log NEW ...' (the best "
        f"records of each task checked and measured into NEW)")

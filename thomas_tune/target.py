"""Targets: what the user types (``llvm``, ``opencl``, a tag, a JSON dict) -> ``tvm.target.Target``.

This TVM takes targets as JSON dicts (plain strings such as ``"llvm"`` raise) or tag names.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess

import tvm

from .files import read_json, write_json_atomically

HOST = {"kind": "llvm"}
GPU_KINDS = ("opencl", "cuda", "vulkan", "metal", "rocm")
# ``--host`` names -> the llvm triple the host code (and, for an llvm target, the kernels) is
# compiled for. A foreign triple is linked with the cross compiler named by TVM_NDK_CC.
HOSTS = {
    "native": None,
    "android-aarch64": "aarch64-linux-android",
    "android-armv7": "armv7a-linux-androideabi",
    "linux-aarch64": "aarch64-linux-gnu",
}
CROSS_CC_ENV = "TVM_NDK_CC"
_ARCH_ALIASES = {"arm64": "aarch64", "amd64": "x86_64", "i686": "x86", "i386": "x86",
                 "armv7a": "arm", "armv7": "arm", "armv7l": "arm", "arm": "arm"}


def _host_spec(host) -> dict | None:
    """``--host`` (a name of HOSTS, an llvm triple, or a JSON dict) -> an llvm target dict, or
    None for this machine."""
    if host is None or isinstance(host, dict):
        return dict(host) if host else None
    host = str(host).strip()
    if host.startswith("{"):
        try:
            return json.loads(host)
        except json.JSONDecodeError as err:
            raise ValueError(f"host {host!r}: invalid JSON ({err})") from err
    if host in HOSTS:
        return {"kind": "llvm", "mtriple": HOSTS[host]} if HOSTS[host] else None
    if host.count("-") >= 2:  # a triple such as aarch64-linux-gnu
        return {"kind": "llvm", "mtriple": host}
    raise ValueError(f"host {host!r}: use one of {', '.join(HOSTS)}, an llvm triple such as "
                     "aarch64-linux-android, or a JSON dict {\"kind\": \"llvm\", \"mtriple\": ...}")


def parse_target(text: str | dict | tvm.target.Target, host=None) -> tvm.target.Target:
    """Build a target from ``llvm``, ``opencl``, ``opencl:N`` (built from what this machine's
    OpenCL device N reports: work-group size, local memory), a tag (``qcom/adreno-opencl``),
    JSON, or a ``.json`` file holding JSON. ``opencl:remote`` (the limits of a device server)
    needs a server or a tuning log: :func:`resolve_target` reads it.

    A GPU target gets an ``llvm`` host. ``host`` (``--host``; or a ``"host"`` key of the JSON
    dict): where the host code runs, a name of ``HOSTS`` (``android-aarch64``,
    ``linux-aarch64``, ``native``), an llvm triple or an llvm target dict. For a GPU target it
    becomes the target's host; an ``llvm`` target itself gets the triple (its kernels run
    there). Raises ValueError naming the accepted forms.
    """
    host_spec = _host_spec(host)
    if isinstance(text, tvm.target.Target):
        if host_spec is None:
            return text
        text = json.loads(str(text.with_host(None) if text.host else text))
    if isinstance(text, str):
        text = text.strip()
        if text.endswith(".json") and not text.startswith("{"):
            try:
                with open(text) as f:
                    text = f.read().strip()
            except OSError as err:
                raise ValueError(f"target file {text!r}: {err.strerror}") from err
        if is_remote(text):
            raise ValueError(f"target {text!r} is read from a device server: tune and export "
                             "take it with --tracker HOST:PORT --key KEY (export also with "
                             f"--log of a tuning run that recorded {DEVICE_FILE})")
        if text.startswith("opencl:") and text[7:].isdigit():
            from .opencl import target_for  # limits as this machine's OpenCL device reports
            return target_for(int(text[7:]))
        if text.startswith("{"):
            try:
                text = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"target {text!r}: invalid JSON ({err})") from err
        elif "/" in text:
            try:
                target = tvm.target.Target(text)
            except Exception as err:  # TVM raises its own error types
                raise ValueError(f"target {text!r}: unknown tag ({err})") from err
            if target.kind.name in GPU_KINDS:
                return tvm.target.Target(target, host=host_spec or HOST)
            if host_spec is None:
                return target
            text = json.loads(str(target))
        else:
            text = {"kind": text}
    if isinstance(text, dict):
        text = dict(text)
        if "host" in text:
            key_host = _host_spec(text.pop("host"))
            host_spec = host_spec or key_host
    try:
        host = host_spec
        kind = text.get("kind") if isinstance(text, dict) else None
        if kind == "llvm" and host is not None:
            # the kernels of an llvm target run on the host: it takes the host's triple
            text = {**host, **{k: v for k, v in text.items() if k != "mtriple"},
                    "mtriple": host.get("mtriple", text.get("mtriple"))}
            host = None
        if host is None and kind in GPU_KINDS:
            host = HOST
        if kind == "llvm" and "num-cores" not in text:
            # MetaSchedule's CPU rules need the core count; default to this machine's.
            text = {**text, "num-cores": os.cpu_count() or 1}
        return tvm.target.Target(text, host=host) if host else tvm.target.Target(text)
    except Exception as err:
        raise ValueError(f"target {text!r}: not a target TVM knows; use llvm, opencl, a tag such "
                         f"as qcom/adreno-opencl, or a JSON dict ({err})") from err


def is_gpu(target: tvm.target.Target) -> bool:
    """True for targets whose kernels need thread bindings (OpenCL, CUDA, Vulkan, ...)."""
    return target.kind.name in GPU_KINDS


#: LLVM's optimisation level for the host code of GPU targets (:func:`codegen_target`)
GPU_HOST_OPT_LEVEL = 0


def codegen_target(target: tvm.target.Target) -> tvm.target.Target:
    """The target to generate code with for ``target``: for a GPU target whose ``llvm`` host
    names no ``opt-level``, the same target with the host at LLVM opt-level 0
    (:data:`GPU_HOST_OPT_LEVEL`); any other target unchanged. The kernels are the device's code
    and do not change (the same OpenCL source, the same numbers).

    Why: a GPU target's host code is one wrapper per kernel that checks and unpacks the
    arguments and launches the kernel; LLVM's optimisation of those wrappers is most of the
    host code generation and of ``export_library``'s time. On PoCL neither a launch nor a
    training step showed a difference it resolves; on other devices the step time has not been
    compared (``docs/opencl.md``). A host dict with its own ``opt-level`` keeps it.

    Only the code generation takes this target: tuning records, the logs and the caches keep
    ``target``."""
    host = target.host
    if not is_gpu(target) or host is None or host.kind.name != "llvm":
        return target
    spec = host.export()
    if "opt-level" in spec:
        return target
    return tvm.target.Target(target, host=dict(spec, **{"opt-level": GPU_HOST_OPT_LEVEL}))


def device_kind(target: tvm.target.Target) -> str:
    """The runtime device name for a target (``cpu``, ``opencl``, ...)."""
    return "cpu" if target.kind.name == "llvm" else target.kind.name


def describe(target: tvm.target.Target) -> str:
    """A short, file-name-safe name for a target, e.g. ``llvm`` or ``opencl-adreno``."""
    dev = str(target.attrs.get("device", "")) if hasattr(target, "attrs") else ""
    return target.kind.name + (f"-{dev}" if dev else "")


# ---- the host the compiled code runs on, and how it is linked --------------------------------
def _arch(triple_or_machine: str) -> str:
    a = triple_or_machine.split("-")[0].lower()
    return _ARCH_ALIASES.get(a, a)


def system_triple() -> str:
    """The llvm triple of this machine (``x86_64-...-linux-gnu``)."""
    return str(tvm.get_global_func("target.llvm_get_system_triple")())


def host_triple(target: tvm.target.Target) -> str:
    """The llvm triple the target's host code (an llvm target's kernels too) is compiled for;
    this machine's triple when the target names none."""
    host = target if target.kind.name == "llvm" else target.host
    triple = str(host.attrs.get("mtriple", "")) if host is not None else ""
    return triple or system_triple()


def host_arch(target_or_triple) -> str:
    """Architecture of a target's host or of a triple: ``aarch64``, ``x86_64``, ``arm``..."""
    triple = (target_or_triple if isinstance(target_or_triple, str)
              else host_triple(target_or_triple))
    return _arch(triple)


def machine_arch() -> str:
    """Architecture of this machine in the same spelling as ``host_arch``."""
    return _arch(platform.machine())


def is_cross(target: tvm.target.Target) -> bool:
    """True when the target's host code is for another architecture than this machine's."""
    return host_arch(target) != machine_arch()


_CC_CHECKED: dict = {}


def cross_compiler(target: tvm.target.Target) -> str | None:
    """The cross compiler that links the target's shared libraries, or None for this machine's
    own (g++). TVM's convention: the ``TVM_NDK_CC`` environment variable names it (the Android
    NDK's ``aarch64-linux-android24-clang++``; ``aarch64-linux-gnu-g++`` for an aarch64 Linux
    board). Checked once per compiler: it must exist and produce code for the host's
    architecture (``-dumpmachine``). Raises ValueError naming the variable and the fix."""
    if not is_cross(target):
        return None
    triple = host_triple(target)
    want = host_arch(triple)
    cc = os.environ.get(CROSS_CC_ENV, "").strip()
    example = (f"the Android NDK's toolchains/llvm/prebuilt/linux-x86_64/bin/{triple}24-clang++"
               if "android" in triple else f"{triple}-g++")
    fix = f"set {CROSS_CC_ENV} to a C++ cross compiler for {triple}, e.g. {example}"
    if not cc:
        raise ValueError(f"the target's host is {triple} (not this {machine_arch()} machine): "
                         f"its shared libraries need a cross compiler; {fix}")
    key = (cc, want)
    if key in _CC_CHECKED:
        return _CC_CHECKED[key]
    path = shutil.which(cc)
    if path is None:
        raise ValueError(f"{CROSS_CC_ENV}={cc!r}: no such compiler; {fix}")
    try:
        dump = subprocess.run([path, "-dumpmachine"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ValueError(f"{CROSS_CC_ENV}={cc!r} does not run ({err}); {fix}") from err
    if not dump or _arch(dump) != want:
        raise ValueError(f"{CROSS_CC_ENV}={cc!r} compiles for {dump or 'an unknown machine'}, "
                         f"not for the target's host {triple}; {fix}")
    _CC_CHECKED[key] = path
    return path


def pack_imports(module, is_system_lib: bool, symbol_prefix: str, workspace_dir: str) -> str:
    """``export_library``'s ``fpack_imports``: the imported modules (the OpenCL kernels) of
    ``module`` packed into an object file of the host's LLVM target (C source where the host
    module is not LLVM), whose ``__tvm_ffi__library_bin`` the loader finds with ``dlsym``.
    Returns the file's path, in ``workspace_dir``.

    TVM's own packing also registers that symbol in the process's system library when
    ``is_system_lib``, and its export sets it for every LLVM host module: it asks
    ``__tvm_is_system_module``, which answers whether the module has a
    ``__tvm_module_startup`` function (``src/target/llvm/llvm_module.cc``), and
    ``CodeGenLLVM::Finish`` adds one to every module (``codegen_llvm.cc``). Each library
    loaded into a process then registers the same name, and every one after the first
    overrides the last with a ``Warning:SystemLib symbol __tvm_ffi__library_bin get
    overriden`` line on stderr. The project loads its libraries with ``load_module``
    (``dlopen``) and links none into a system library, so only a module built with a
    system-library prefix (``system-lib-prefix`` on the host target, which records a
    ``tvm_system_lib_prefix`` flag) keeps the registration."""
    from tvm.runtime import _ffi_api
    llvm = [m for m in module._collect_dso_modules() if m.kind == "llvm"]
    system = is_system_lib and any(
        m.get_function("__tvm_get_system_lib_prefix")() is not None for m in llvm)
    if llvm and _ffi_api.RuntimeEnabled("llvm"):
        packed = _ffi_api.ModulePackImportsToLLVM(
            module, system, llvm[0].get_function("_get_target_string")(), symbol_prefix)
        path = os.path.join(workspace_dir, f"{symbol_prefix}devc.o")
        packed.write_to_file(path)
        return path
    path = os.path.join(workspace_dir, f"{symbol_prefix}devc.c")
    with open(path, "w") as f:
        f.write(_ffi_api.ModulePackImportsToC(module, system, symbol_prefix))
    return path


def export_shared(module, path: str, target: tvm.target.Target) -> None:
    """``module.export_library(path)`` linked for the target's host: with this machine's
    compiler, or for a foreign host with ``cross_compiler(target)`` (TVM's
    ``tvm.support.ndk.create_shared``); its imports packed by :func:`pack_imports`, so that
    loading it registers nothing in the process's system library. Raises ValueError for a
    missing or wrong cross compiler, RuntimeError with the compiler's output when linking
    fails."""
    cc = cross_compiler(target)
    if cc is None:
        module.export_library(path, fpack_imports=pack_imports)
        return
    from tvm.support import ndk
    os.environ[CROSS_CC_ENV] = cc
    module.export_library(path, fcompile=ndk.create_shared, fpack_imports=pack_imports)


# ---- the device's own limits, read from a device server over RPC ----------------------------
REMOTE = "remote"  # ``--target opencl:remote``
DEVICE_FILE = "device.json"  # in a tuning-log folder: the device the log was tuned on
# MetaSchedule's thread-extent choices stop at 1024 work-items, as for ``opencl:N``
# (:func:`thomas_tune.opencl.target_for`): PoCL reports 4096 work-items per work-group.
MAX_THREADS_CAP = 1024


def is_remote(text) -> bool:
    """True for ``KIND:remote`` (e.g. ``opencl:remote``): a target read from a device server."""
    return isinstance(text, str) and text.strip().endswith(":" + REMOTE)


def device_limits(session, kind: str = "opencl", index: int = 0) -> dict:
    """The limits a device server's runtime reports for its device ``kind``/``index``, read
    over the RPC ``session`` with TVM's device attributes (``src/runtime/rpc/rpc_device_api.cc``
    forwards ``GetAttr`` to the server's device API: TVM's OpenCL runtime,
    ``src/backend/opencl/runtime/opencl_device_api.cc``, or thomas_tune's sidecar):
    ``max_threads_per_block`` (``CL_DEVICE_MAX_WORK_GROUP_SIZE``, work-items),
    ``max_shared_memory_per_block`` (``CL_DEVICE_LOCAL_MEM_SIZE``, bytes), ``warp_size``
    (TVM's OpenCL runtimes report 1, or ``TVM_OPENCL_WARP_SIZE`` from the server's
    environment), ``device_name``, ``compute_version``, ``multi_processor_count``,
    ``max_clock_rate_khz``, ``total_global_memory`` (bytes) where answered; and ``opencl``:
    the driver's own answers (sub-group sizes, local-memory type...) from
    :func:`thomas_tune.rpc.opencl_device_info` on servers that register it (thomas_tune's),
    else absent. Raises ValueError when the server has no such device."""
    from .rpc import DEVICE_INFO_FUNC
    dev = session.device(kind, index)
    if not dev.exist:
        raise ValueError(f"the device server has no {kind} device {index}: start it with an "
                         f"OpenCL runtime (TVM built with USE_OPENCL=ON, or thomas-tune rpc "
                         f"server --target opencl) and a driver that lists a device")
    limits = {"kind": kind, "index": index,
              "max_threads_per_block": int(dev.max_threads_per_block),
              "max_shared_memory_per_block": int(dev.max_shared_memory_per_block),
              "warp_size": int(dev.warp_size)}
    extra = {"device_name": "device_name", "compute_version": "compute_version",
             "multi_processor_count": "multi_processor_count",
             "max_clock_rate_khz": "max_clock_rate", "total_global_memory": "total_global_memory"}
    for key, attr in extra.items():
        try:
            value = getattr(dev, attr)
        except Exception:  # an attribute the server's runtime does not answer
            continue
        if value is not None:
            limits[key] = value if isinstance(value, str) else int(value)
    try:
        info = session.get_function(DEVICE_INFO_FUNC)
    except Exception:  # TVM's own tvm_rpc: TVM's attributes only
        info = None
    if info is not None and "device_name" in limits:
        limits["opencl"] = json.loads(str(info(limits["device_name"])))
    return limits


def read_device_limits(tracker: tuple[str, int], key: str, kind: str = "opencl",
                       wait_s: float = 60.0, session_timeout_s: int = 120) -> dict:
    """:func:`device_limits` of a device server of ``key`` on ``tracker``, in one session of
    at most ``session_timeout_s`` s (whole seconds), waiting up to ``wait_s`` s for a free
    server; adds ``key``. Raises TimeoutError when none is free, ValueError as
    :func:`device_limits`."""
    from .rpc import request_session, wait_for_key
    wait_for_key(tracker, key, timeout=wait_s)
    session = request_session(tracker, key, session_timeout_s)
    try:
        return {"key": key, **device_limits(session, kind)}
    finally:
        del session


def target_from_limits(limits: dict, host=None) -> tvm.target.Target:
    """An OpenCL target whose ``max_threads_per_block`` / ``max_num_threads`` (capped at
    :data:`MAX_THREADS_CAP`), ``max_shared_memory_per_block`` and ``thread_warp_size`` are a
    device's (:func:`device_limits`), with the host of ``host`` (``--host``) or this machine.
    ``device`` is ``adreno`` or ``mali`` when the device's name says so, else ``generic``.
    Raises ValueError for limits of another kind or with a non-positive value."""
    if limits.get("kind") != "opencl":
        raise ValueError(f"device limits of kind {limits.get('kind')!r}: only opencl devices "
                         "have a remote target here")
    names = ("max_threads_per_block", "max_shared_memory_per_block", "warp_size")
    bad = [n for n in names if not isinstance(limits.get(n), int) or limits[n] <= 0]
    if bad:
        raise ValueError(f"device limits {limits}: {', '.join(bad)} missing or not > 0")
    name = str(limits.get("device_name", "")).lower()
    device = "adreno" if "adreno" in name else "mali" if "mali" in name else "generic"
    threads = min(limits["max_threads_per_block"], MAX_THREADS_CAP)
    spec = {"kind": "opencl", "device": device, "max_threads_per_block": threads,
            "max_num_threads": threads,
            "max_shared_memory_per_block": limits["max_shared_memory_per_block"],
            "thread_warp_size": limits["warp_size"]}
    return tvm.target.Target(spec, host=_host_spec(host) or HOST)


def write_device_file(folder: str, limits: dict) -> str:
    """Write ``limits`` (:func:`device_limits`) as ``folder``/:data:`DEVICE_FILE` (a tuning-log
    folder: the device its records were measured on), atomically; returns the path."""
    path = os.path.join(folder, DEVICE_FILE)
    write_json_atomically(path, limits)
    return path


def read_device_file(folder: str) -> dict | None:
    """The limits :func:`write_device_file` recorded in ``folder``, or None when it holds none.
    Raises ValueError for a file that is not a JSON object."""
    path = os.path.join(folder, DEVICE_FILE)
    if not os.path.exists(path):
        return None
    limits = read_json(path, f"{path}: not readable as JSON ({{err}}); delete it and tune "
                             "again with --target opencl:remote")
    if not isinstance(limits, dict):
        raise ValueError(f"{path}: expected a JSON object of device limits")
    return limits


def resolve_target(text, host=None, tracker: tuple[str, int] | None = None,
                   key: str | None = None, log_dir: str | None = None,
                   wait_s: float = 60.0) -> tuple[tvm.target.Target, dict | None]:
    """``--target`` as :func:`parse_target` reads it, except ``opencl:remote``: the limits of
    the device server of ``key`` on ``tracker`` (:func:`read_device_limits`) when both are
    given, else the limits recorded in the tuning log ``log_dir`` (:data:`DEVICE_FILE`), made
    into a target by :func:`target_from_limits`. Returns (target, limits or None).
    Raises ValueError naming the fix when neither a server nor a recorded device is at hand."""
    if not is_remote(text):
        return parse_target(text, host), None
    kind = text.strip()[: -len(REMOTE) - 1]
    if kind != "opencl":
        raise ValueError(f"target {text!r}: only opencl:remote is read from a device server")
    if tracker is not None and key:
        limits = read_device_limits(tracker, key, kind, wait_s=wait_s)
    else:
        limits = read_device_file(log_dir) if log_dir else None
        if limits is None:
            raise ValueError(f"target {text!r} is read from a device server: give --tracker "
                             "HOST:PORT and --key KEY, or --log of a tuning run made with "
                             f"--target {text} (its {DEVICE_FILE} records the device)")
    return target_from_limits(limits, host), limits

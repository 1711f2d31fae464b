"""The OpenCL runtime sidecar: build it once, load it into TVM.

The pinned TVM wheel generates OpenCL C but has no OpenCL runtime. ``csrc/opencl_runtime.cc``
provides one (the ``device_api.opencl`` device API and the ``opencl`` module loader). It is
compiled with the system C++ compiler against the headers the wheel ships and the OpenCL ICD
loader, the first time it is needed, into a cache keyed by the source and the TVM version; then
loaded with ``RTLD_GLOBAL`` so that TVM finds its registrations.

Set ``THOMAS_TUNE_OPENCL_PLATFORM`` to a platform index or name substring (``Portable`` for PoCL,
``NVIDIA``) to choose which devices ``tvm.opencl(i)`` enumerates.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sysconfig
import threading

import tvm
import tvm_ffi

from .files import replacing

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "opencl_runtime.cc")
_loaded: str | None = None
#: kernels per call of TVM's OpenCL code generator in a library build (:func:`_chunked_build`)
CODEGEN_CHUNK = 40
#: TVM's own ``target.build.opencl``, kept when :func:`load` puts :func:`_chunked_build` there
_tvm_build_opencl = None
#: the pieces :func:`_create_module` collects for :func:`_chunked_build` in this thread
_pieces = threading.local()


class OpenCLUnavailable(RuntimeError):
    """The sidecar cannot be built or loaded here; the message says what is missing."""


def cache_dir() -> str:
    """The project's cache folder, made when missing: ``$THOMAS_TUNE_CACHE``, else
    ``$XDG_CACHE_HOME/thomas_tune``, else ``~/.cache/thomas_tune``. The sidecar lives here, and
    every other cache of thomas_tune (default schedules, unpacked logs, device peaks) keeps a
    folder in it."""
    base = os.environ.get("THOMAS_TUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "thomas_tune")
    os.makedirs(base, exist_ok=True)
    return base


def library_path() -> str:
    """Where the sidecar for this source and this TVM lives (built or not)."""
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + tvm.__version__.encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), f"libtvm_runtime_opencl-{key}.so")


def _find_opencl_lib() -> str | None:
    # THOMAS_TUNE_OPENCL_LIB names the ICD loader (or a vendor libOpenCL) explicitly.
    explicit = os.environ.get("THOMAS_TUNE_OPENCL_LIB")
    if explicit:
        if not os.path.exists(explicit):
            raise OpenCLUnavailable(f"THOMAS_TUNE_OPENCL_LIB={explicit!r} does not exist")
        return explicit
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
              "/usr/local/lib", sysconfig.get_config_var("LIBDIR") or ""):
        for name in ("libOpenCL.so", "libOpenCL.so.1"):
            if d and os.path.exists(os.path.join(d, name)):
                return os.path.join(d, name)
    return None


def build(force: bool = False) -> str:
    """Compile the sidecar if needed; returns its path.

    Raises OpenCLUnavailable naming what is missing (a C++ compiler, the OpenCL headers, the
    ICD loader) and how to install it, with the compiler's output when compilation fails.
    """
    out = library_path()
    if os.path.exists(out) and not force:
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise OpenCLUnavailable("no C++ compiler to build the OpenCL runtime: install g++")
    if not any(os.path.exists(os.path.join(d, "CL", "cl.h"))
               for d in ("/usr/include", "/usr/local/include")):
        raise OpenCLUnavailable("OpenCL headers (CL/cl.h) are missing: apt-get install "
                                "opencl-headers ocl-icd-opencl-dev")
    cl_lib = _find_opencl_lib()
    if cl_lib is None:
        raise OpenCLUnavailable("the OpenCL ICD loader (libOpenCL.so) is missing: apt-get install "
                                "ocl-icd-opencl-dev (and a driver, e.g. pocl-opencl-icd)")
    tvm_dir = os.path.dirname(tvm.__file__)
    ffi_dir = os.path.dirname(tvm_ffi.__file__)
    with replacing(out, executable=True) as tmp:
        cmd = [cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-o", tmp, SOURCE,
               f"-I{tvm_dir}/include", f"-I{ffi_dir}/include",
               f"-L{tvm_dir}/lib", f"-L{ffi_dir}/lib", "-ltvm_runtime", "-ltvm_ffi", cl_lib,
               f"-Wl,-rpath,{tvm_dir}/lib", f"-Wl,-rpath,{ffi_dir}/lib"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise OpenCLUnavailable(f"building the OpenCL runtime failed:\n{' '.join(cmd)}\n"
                                    f"{proc.stderr[-4000:]}")
    return out


def serialize(fmt: str, fmap, source: str) -> bytes:
    """The byte layout TVM embeds for an "opencl" module (and the sidecar loads): u64-length
    prefixed strings; format; a map name -> (name, argument dtypes as code u8 / bits u8 /
    lanes u16, launch tags, one int32 extra tag per argument); the OpenCL C source."""
    out = bytearray()

    def u64(n):
        out.extend(int(n).to_bytes(8, "little"))

    def text(t):
        b = t.encode() if isinstance(t, str) else bytes(t)
        u64(len(b))
        out.extend(b)

    text(fmt)
    u64(len(fmap))
    for key, info in fmap.items():
        text(str(key))
        text(str(info.name))
        u64(len(info.arg_types))
        for dt in info.arg_types:
            out.extend(bytes([dt.type_code, dt.bits]) + int(dt.lanes).to_bytes(2, "little"))
        u64(len(info.launch_param_tags))
        for tag in info.launch_param_tags:
            text(str(tag))
        u64(len(info.arg_extra_tags))
        for tag in info.arg_extra_tags:
            out.extend(int(tag).to_bytes(4, "little", signed=True))
    text(source)
    return bytes(out)


_PROTOTYPE = re.compile(r"^\s*__kernel\s+void\s+(\w+)\s*\([^{;]*\)\s*;\s*$")


def compact_source(source: str) -> str:
    """``source`` with each kernel prototype kept once.

    TVM's OpenCL codegen emits, before every kernel, prototypes of all kernels of the module, so
    a module of n kernels carries n^2 prototypes: 267k lines (60 MB) for the 517 kernels of a
    MobileNetV2 training step, which bloats the exported library and the OpenCL program build.
    Repeated prototypes are legal C but useless; the definitions are untouched."""
    seen, out = set(), []
    for line in source.splitlines(keepends=True):
        m = _PROTOTYPE.match(line)
        if m:
            if m.group(1) in seen:
                continue
            seen.add(m.group(1))
        out.append(line)
    return "".join(out)


def _create_module(data, fmt, fmap, source):
    # Called by TVM's OpenCL codegen (as "ffi.Module.create.opencl") for every compiled module,
    # so that tvm.compile's result runs directly, not only after export and load.
    if str(fmt) != "cl":
        raise ValueError(f"OpenCL module format {fmt!r} is not supported (only 'cl' source)")
    loader = tvm_ffi.get_global_func("ffi.Module.load_from_bytes.opencl")
    source_text = data if isinstance(data, str) else bytes(data).decode()
    collected = getattr(_pieces, "out", None)
    if collected is not None:
        collected.append((source_text, dict(fmap.items())))
    return loader(serialize("cl", fmap, compact_source(source_text)))


def _chunked_build(mod: tvm.IRModule, target: tvm.target.Target):
    """TVM's OpenCL code generator (``target.build.opencl``) on ``mod``, :data:`CODEGEN_CHUNK`
    kernels at a time, the pieces joined into one module: their OpenCL C one after the other,
    their maps of kernel names to argument types merged.

    The generator writes, before each kernel, a prototype of every kernel of its module, so
    its time grows with the square of the kernel count: on a 2-core x86-64 host, 0.12 s for
    the first 40 kernels of MobileNetV2 0.35@64's training step, 1.93 s for 160, 8.95 s for all
    318. Each kernel's definition is the generator's own either way; only the prototypes,
    which :func:`compact_source` keeps once per module, sit in other places
    (``tests/test_opencl_runtime.py`` compares both builds kernel by kernel)."""
    funcs = list(mod.functions.items())
    if len(funcs) <= CODEGEN_CHUNK:
        return _tvm_build_opencl(mod, target)
    pieces: list = []
    outer, _pieces.out = getattr(_pieces, "out", None), pieces
    try:
        for i in range(0, len(funcs), CODEGEN_CHUNK):
            _tvm_build_opencl(tvm.IRModule(dict(funcs[i:i + CODEGEN_CHUNK]), attrs=mod.attrs),
                              target)
    finally:
        _pieces.out = outer  # a collector around this build sees the joined module only
    fmap: dict = {}
    for _, part in pieces:
        fmap.update(part)
    return _create_module("\n".join(text for text, _ in pieces), "cl", fmap, None)


def load() -> str:
    """Build (if needed) and load the sidecar once per process; returns its path."""
    global _loaded, _tvm_build_opencl
    if _loaded is None:
        path = build()
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        tvm.register_global_func("ffi.Module.create.opencl", _create_module, override=True)
        if _tvm_build_opencl is None:  # absent where TVM loaded its runtime library only
            _tvm_build_opencl = tvm_ffi.get_global_func("target.build.opencl", allow_missing=True)
        if _tvm_build_opencl is not None:
            tvm.register_global_func("target.build.opencl", _chunked_build, override=True)
        _loaded = path
    return _loaded


def available() -> bool:
    """True when the sidecar loads and sees at least one OpenCL device."""
    try:
        load()
    except OpenCLUnavailable:
        return False
    return num_devices() > 0


def stats() -> dict:
    """Counters of this process's sidecar: ``source_builds`` (programs compiled from OpenCL C),
    ``binary_loads`` (programs created from the on-disk binary cache), ``binary_rejected``
    (cache files not used: damaged or refused by the driver; the program was then built from
    source), ``binary_writes`` / ``write_failures`` (cache files written / not written),
    ``launches`` (kernels enqueued), ``source_build_s`` / ``binary_load_s`` (seconds spent);
    device memory in bytes: ``device_bytes`` (buffers allocated and not yet released, the
    runtime's pooled workspaces included), ``device_peak_bytes`` (the most since
    :func:`reset_peak`, or since the process began), ``launch_arg_bytes`` (the sizes of the
    buffers given to each kernel launched, summed over launches: what the kernels may read and
    write, an upper bound of their memory traffic)."""
    import json
    load()
    return json.loads(str(tvm_ffi.get_global_func("thomas_tune.opencl.stats")()))


def reset_peak() -> None:
    """Start a new ``device_peak_bytes`` (:func:`stats`) from the bytes allocated now."""
    load()
    tvm_ffi.get_global_func("thomas_tune.opencl.reset_peak")()


def record_start() -> None:
    """Start recording the kernels this thread launches (an OpenCL event per launch; the
    sidecar's queues are created with ``CL_QUEUE_PROFILING_ENABLE``), for
    :func:`record_stop`."""
    load()
    tvm_ffi.get_global_func("thomas_tune.opencl.record_start")()


def record_stop() -> dict:
    """Stop recording (:func:`record_start`), wait for the recorded kernels and return the
    device's own timing of them from their profiling events (``CL_PROFILING_COMMAND_START`` /
    ``END``, OpenCL 1.2 section 5.12): ``kernels`` (how many), ``busy_ms`` (the sum of their
    execution times), ``span_ms`` (from the first one's start to the last one's end: the
    gaps in which the device waited for the host's next launch included; the figure that
    compares with a CUDA event pair around the same work), milliseconds. Raises
    tvm.error.InternalError (with the OpenCL error) when waiting for a kernel fails."""
    import json
    load()
    r = json.loads(str(tvm_ffi.get_global_func("thomas_tune.opencl.record_stop")()))
    return {"kernels": r["kernels"], "busy_ms": r["busy_ns"] * 1e-6,
            "span_ms": r["span_ns"] * 1e-6}


def binary_cache_dir() -> str:
    """The folder of the OpenCL program-binary cache ("" when ``THOMAS_TUNE_OPENCL_CACHE=off``):
    ``THOMAS_TUNE_OPENCL_CACHE``, else ``$THOMAS_TUNE_CACHE/opencl``, else
    ``~/.cache/thomas_tune/opencl``. Read at each program build, so it may change at run time.
    On PoCL (which keeps its own kernel cache) programs use it only when
    ``THOMAS_TUNE_OPENCL_CACHE`` names a folder: docs/opencl.md says why."""
    load()
    return str(tvm_ffi.get_global_func("thomas_tune.opencl.cache_dir")())


def num_devices() -> int:
    return int(tvm_ffi.get_global_func("thomas_tune.opencl.num_devices")())


def devices() -> str:
    """``index: device [platform]; ...`` for the devices ``tvm.opencl(i)`` can open."""
    load()
    return str(tvm_ffi.get_global_func("thomas_tune.opencl.devices")())


def target_for(index: int = 0) -> tvm.target.Target:
    """An OpenCL target from what device ``index`` reports (threads per work-group, local
    memory), with an ``llvm`` host."""
    load()
    dev = tvm.opencl(index)
    if not dev.exist:
        raise OpenCLUnavailable(f"OpenCL device {index} does not exist; devices: {devices()}")
    return tvm.target.Target({"kind": "opencl", "device": "generic",
                              "max_threads_per_block": min(int(dev.max_threads_per_block), 1024),
                              "max_shared_memory_per_block":
                                  int(dev.max_shared_memory_per_block),
                              "max_num_threads": min(int(dev.max_threads_per_block), 1024),
                              "thread_warp_size": 1}, host={"kind": "llvm"})

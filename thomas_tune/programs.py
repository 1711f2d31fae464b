"""OpenCL programs compiled once per device, for exports run in TVM's own RPC server.

On a phone an export runs in ``tvm_rpc``'s session process with TVM's own OpenCL runtime, which
builds each kernel's program from OpenCL C at its first launch; every session (each ``train``,
``infer``, each renewal of :class:`thomas_tune.runtime.Session`) is a new process and builds
them all again, and a mobile driver may take seconds per program and keep nothing. TVM's OpenCL
module (``src/backend/opencl/runtime/opencl_module.cc``) offers two functions, reached through
the loaded library (an RPC module's ``get_function`` searches its imports):

- ``opencl.GetPreCompiledPrograms()``: every kernel's program built (from source where it was
  not yet), returned as one stream: u64 count, then per kernel its name and the driver's binary
  (``clGetProgramInfo(CL_PROGRAM_BINARIES)``), each as a u64 length and its bytes (little
  endian, :func:`parse`).
- ``opencl.SetPreCompiledPrograms(bytes)``: the programs created from those binaries
  (``clCreateProgramWithBinary``, ``clBuildProgram``) before any launch.

The first returns a C++ string, which TVM's RPC server sends as a C string: it stops at the
first zero byte (``src/runtime/rpc/rpc_local_session.cc``, ``EncodeReturn``). A helper library
of a few lines (:data:`HELPER_SOURCE`), compiled here for the device's architecture with the
compiler that links the export (``TVM_NDK_CC`` for another architecture, ``g++`` otherwise),
loaded in the session as a module, calls it on the device and returns the result as bytes.

A :class:`ProgramCache` keeps the streams on this machine, one file per library and device:
``<folder>/<device>-<hash of name and driver>/<library>-<sha256 of the library>.bin``, the
folder ``THOMAS_TUNE_PROGRAM_CACHE`` (``off`` turns the cache off), else
``$THOMAS_TUNE_CACHE/programs``, else ``~/.cache/thomas_tune/programs``. A session sets the
stored stream of each library it loads before the first launch; after the session's first call
it fetches (and stores) the stream of each library that had none stored. A stream the driver
rejects (``SetPreCompiledPrograms`` raises: ``CL_INVALID_BINARY``, a failed build) is dropped,
the library loaded again so that its programs build from source, and a new stream fetched
after the first call replaces the file. A fetch starts only where the session's bound leaves
room for it (:meth:`SessionPrograms.after_first_call`). Nothing is kept on the device:
``tvm_rpc`` removes a session's folder when the session ends, and the stream is uploaded with
each session instead.

Exports for the CPU (no OpenCL module) and device servers whose OpenCL runtime is thomas_tune's
sidecar (it keeps its own binaries, ``thomas_tune/csrc/opencl_runtime.cc``) are left as they
are. A failure here never fails a run: it is recorded in :attr:`SessionPrograms.events` and the
programs build from source as before.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time

GET, SET = "opencl.GetPreCompiledPrograms", "opencl.SetPreCompiledPrograms"
HELPER_FUNC = "thomas_tune_call_as_bytes"
CACHE_ENV = "THOMAS_TUNE_PROGRAM_CACHE"

# thomas_tune_call_as_bytes(module, name): calls the function ``name`` of the module or of its
# imports, with no arguments, on the device and returns its string as bytes, which RPC carries
# whole (a function cannot be an argument over RPC; a module can). Plain C ABI of tvm-ffi
# (tvm/ffi/c_api.h); the library module exposes ``__tvm_ffi_<name>`` symbols as functions.
HELPER_SOURCE = r"""
#include <tvm/ffi/c_api.h>

static void SetNone(TVMFFIAny* v) {
  v->type_index = kTVMFFINone;
  v->zero_padding = 0;
  v->v_int64 = 0;
}

static void Release(TVMFFIAny* v) {
  if (v->type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(v->v_obj);
}

extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_thomas_tune_call_as_bytes(
    void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  if (num_args != 2 || args[0].type_index != kTVMFFIModule) {
    TVMFFIErrorSetRaisedFromCStr("TypeError", "thomas_tune_call_as_bytes(module, name)");
    return -1;
  }
  TVMFFIObjectHandle get_function = nullptr;
  TVMFFIByteArray get_name = {"ffi.ModuleGetFunction", 21};
  if (TVMFFIFunctionGetGlobal(&get_name, &get_function) != 0) return -1;
  if (get_function == nullptr) {
    TVMFFIErrorSetRaisedFromCStr("RuntimeError", "ffi.ModuleGetFunction is not registered");
    return -1;
  }
  TVMFFIAny query[3] = {args[0], args[1], args[1]};
  query[2].type_index = kTVMFFIBool;
  query[2].zero_padding = 0;
  query[2].v_int64 = 1;  // search the module's imports
  TVMFFIAny func, out, unused;
  SetNone(&func);
  SetNone(&out);
  int rc = TVMFFIFunctionCall(get_function, query, 3, &func);
  TVMFFIObjectDecRef(get_function);
  if (rc != 0) return -1;
  if (func.type_index != kTVMFFIFunction) {
    Release(&func);
    TVMFFIErrorSetRaisedFromCStr("AttributeError", "the module has no such function");
    return -1;
  }
  rc = TVMFFIFunctionCall(func.v_obj, &unused, 0, &out);
  Release(&func);
  if (rc != 0) return -1;
  TVMFFIByteArray view;
  if (out.type_index == kTVMFFIStr || out.type_index == kTVMFFIBytes) {
    view = *TVMFFIBytesGetByteArrayPtr(out.v_obj);
  } else if (out.type_index == kTVMFFISmallStr || out.type_index == kTVMFFISmallBytes) {
    view = TVMFFISmallBytesGetContentByteArray(&out);
  } else {
    Release(&out);
    TVMFFIErrorSetRaisedFromCStr("TypeError", "the function returned no string");
    return -1;
  }
  rc = TVMFFIBytesFromByteArray(&view, result);
  Release(&out);
  return rc;
}
"""


def cache_folder() -> str | None:
    """The folder of the stored programs (see the module's docstring), or None when
    ``THOMAS_TUNE_PROGRAM_CACHE=off``."""
    named = os.environ.get(CACHE_ENV, "").strip()
    if named.lower() == "off":
        return None
    if named:
        return named
    base = os.environ.get("THOMAS_TUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "thomas_tune")
    return os.path.join(base, "programs")


def parse(blob: bytes) -> dict[str, bytes]:
    """``opencl.GetPreCompiledPrograms``'s stream -> {kernel name: the driver's binary}.
    Raises ValueError for a stream that is cut short, has bytes left over, or holds an empty
    binary (what ``SetPreCompiledPrograms`` would read past its end or reject)."""
    pos, out = 0, {}

    def take(n: int) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(blob):
            raise ValueError(f"program stream cut short at byte {pos} of {len(blob)}")
        pos += n
        return blob[pos - n:pos]

    count = struct.unpack("<Q", take(8))[0]
    for _ in range(count):
        name = take(struct.unpack("<Q", take(8))[0]).decode("utf-8", "replace")
        binary = take(struct.unpack("<Q", take(8))[0])
        if not binary:
            raise ValueError(f"program stream: kernel {name!r} has an empty binary")
        out[name] = binary
    if pos != len(blob):
        raise ValueError(f"program stream: {len(blob) - pos} bytes after {count} programs")
    return out


def pack(programs: dict[str, bytes]) -> bytes:
    """The stream :func:`parse` reads, from {kernel name: binary}."""
    parts = [struct.pack("<Q", len(programs))]
    for name, binary in programs.items():
        raw = name.encode()
        parts += [struct.pack("<Q", len(raw)), raw, struct.pack("<Q", len(binary)), binary]
    return b"".join(parts)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")[:40] or "device"


def file_digest(path: str) -> str:
    """sha256 of a file's bytes, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class ProgramCache:
    """Program streams on this machine, one file per (device, library); ``folder`` as
    :func:`cache_folder` gives it. Writes are atomic (a temporary file renamed)."""

    def __init__(self, folder: str):
        self.folder = folder

    def path(self, device: tuple[str, str], library: str) -> str:
        """The file of ``library`` (a path; keyed by its name and sha256) built by the driver
        ``device`` = (device name, driver version)."""
        dev = hashlib.sha256("\0".join(device).encode()).hexdigest()[:12]
        name = os.path.splitext(os.path.basename(library))[0]
        return os.path.join(self.folder, f"{_slug(device[0])}-{dev}",
                            f"{name}-{file_digest(library)[:16]}.bin")

    def get(self, device, library) -> bytes | None:
        """The stored stream, or None (none stored, or one that :func:`parse` refuses: it is
        removed)."""
        path = self.path(device, library)
        try:
            with open(path, "rb") as f:
                blob = f.read()
            parse(blob)
            return blob
        except FileNotFoundError:
            return None
        except ValueError:
            self.drop(device, library)
            return None

    def put(self, device, library, blob: bytes) -> str:
        """Store ``blob`` (checked with :func:`parse`) for the pair; returns its path."""
        parse(blob)
        path = self.path(device, library)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
        return path

    def drop(self, device, library) -> None:
        """Remove the pair's file, if any."""
        try:
            os.remove(self.path(device, library))
        except FileNotFoundError:
            pass


def helper_library(triple: str | None) -> str:
    """The helper (:data:`HELPER_SOURCE`) compiled for the architecture of ``triple`` (the
    export's host; None: this machine), cached next to the stored programs (or in the temporary
    folder). Raises RuntimeError with the compiler's output when it does not build, ValueError
    when a cross compiler is needed and ``TVM_NDK_CC`` is unset."""
    import tvm_ffi

    from .target import CROSS_CC_ENV, host_arch, machine_arch
    arch = host_arch(triple) if triple else machine_arch()
    cc = os.environ.get(CROSS_CC_ENV, "").strip() if arch != machine_arch() else "g++"
    if not cc:
        raise ValueError(f"the device is {arch}: fetching its compiled OpenCL programs needs "
                         f"a C++ compiler for it; set {CROSS_CC_ENV} as for export")
    key = hashlib.sha256(f"{HELPER_SOURCE}\0{cc}\0{arch}".encode()).hexdigest()[:16]
    folder = cache_folder() or tempfile.gettempdir()
    path = os.path.join(folder, "helpers", f"call_as_bytes-{arch}-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="thomas-tune-helper-") as tmp:
        src, out = os.path.join(tmp, "helper.cc"), os.path.join(tmp, "helper.so")
        with open(src, "w") as f:
            f.write(HELPER_SOURCE)
        cmd = [shutil.which(cc) or cc, "-shared", "-fPIC", "-O2", "-fno-exceptions",
               "-fno-rtti", "-I", tvm_ffi.libinfo.find_include_path(), "-o", out, src]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise RuntimeError(f"{cc} did not compile the program helper: {err}") from err
        if done.returncode != 0:
            raise RuntimeError(f"{cc} did not compile the program helper:\n"
                               f"{done.stderr[-2000:]}")
        os.replace(out, path)
    return path


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return (lines or [type(err).__name__])[-1][:300]


class SessionPrograms:
    """The compiled programs of one :class:`thomas_tune.runtime.Session` over RPC.

    :meth:`load` replaces ``rpc_session.load_module(name)``: it loads the library and sets its
    stored programs (loading it again when the driver rejects them); :meth:`after_first_call`
    fetches and stores the programs of each library loaded in the current session that had
    none. ``events``: one dict per action (``library``, ``action`` in "set", "rejected",
    "stored", "postponed", "skipped", ``programs``, ``bytes``, ``seconds``, ``reason`` where
    one applies).
    ``cache``: a :class:`ProgramCache`, or None (the cache off: nothing happens)."""

    def __init__(self, cache: ProgramCache | None = None, triple: str | None = None):
        folder = cache_folder()
        self.cache = cache or (ProgramCache(folder) if folder else None)
        self.triple = triple
        self.events: list[dict] = []
        self._pending: list[tuple] = []  # (rpc session, module, local path, device key)
        self._slowest_first_call_s = 0.0  # of every session so far (renewals included)

    def _event(self, library: str, action: str, **info) -> None:
        self.events.append({"library": os.path.basename(library), "action": action, **info})

    def load(self, rpc_session, name: str, local_path: str, device):
        """The library ``name`` (uploaded already; ``local_path`` is its copy here) loaded in
        ``rpc_session``, its programs set from the cache for ``device`` (a TVM device of the
        session) when stored; TVM's errors from ``load_module`` are raised as they are."""
        module = rpc_session.load_module(name)
        if self.cache is None or int(device.dlpack_device_type()) % 128 != 4:  # kDLOpenCL
            return module
        try:
            setter = module.get_function(SET)
            key = (device.device_name, device.driver_version)
            blob = self.cache.get(key, local_path)
        except Exception:  # no OpenCL module, or not TVM's own (the sidecar keeps its own)
            return module
        if blob is not None:
            t0 = time.perf_counter()
            try:
                setter(blob)
                self._event(local_path, "set", programs=len(parse(blob)), bytes=len(blob),
                            seconds=time.perf_counter() - t0)
                return module
            except Exception as err:  # TVM raises its own error types
                self._event(local_path, "rejected", reason=_first_line(err),
                            seconds=time.perf_counter() - t0)
                self.cache.drop(key, local_path)
                del setter, module  # a half-set module may hold failed programs
                module = rpc_session.load_module(name)
        self._pending.append((rpc_session, module, local_path, key))
        return module

    def after_first_call(self, first_call_s: float, remaining) -> None:
        """Fetch and store the programs of the libraries loaded without stored ones (all
        programs of a library are built now, those its first call did not launch too).
        ``remaining``: a function giving the seconds the session has left for this (its
        bound less what the next call needs), or None where the bound is not known (a
        session given as it is rather than through a RemoteDevice). A library's fetch starts
        only with at least twice the slowest first call of this object's sessions (s; a first
        call that built programs takes about what building a library's programs takes, and
        after a renewal the first call may have found its programs stored while another
        library still has none) plus 5 s left; otherwise, and where the bound is not known,
        it is ``postponed`` to a later session: a fetch that outlasted its session would
        take the session's state with it."""
        pending, self._pending = self._pending, []
        self._slowest_first_call_s = max(self._slowest_first_call_s, first_call_s)
        helper = None
        for rpc_session, module, local_path, key in pending:
            need = 2.0 * self._slowest_first_call_s + 5.0
            left = remaining() if remaining is not None else None
            if left is None or left < need:
                why = ("the session's bound is not known" if left is None else
                       f"{left:.0f} s left of the session, {need:.0f} s wanted")
                self._event(local_path, "postponed", seconds=0.0, reason=why)
                continue
            t0 = time.perf_counter()
            try:
                if helper is None:
                    helper = self._helper(rpc_session)
                blob = bytes(helper(module, GET))
                self.cache.put(key, local_path, blob)
                self._event(local_path, "stored", programs=len(parse(blob)), bytes=len(blob),
                            seconds=time.perf_counter() - t0)
            except Exception as err:  # TVM's errors, the compiler's, the session's end
                self._event(local_path, "skipped", reason=_first_line(err),
                            seconds=time.perf_counter() - t0)

    def release(self) -> None:
        """Let go of the sessions and modules held for a fetch (a session ending before its
        first call stores nothing)."""
        self._pending = []

    def _helper(self, rpc_session):
        path = helper_library(self.triple)
        name = os.path.basename(path)
        rpc_session.upload(path, name)
        return rpc_session.load_module(name).get_function(HELPER_FUNC)

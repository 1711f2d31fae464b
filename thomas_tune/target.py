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
    JSON, or a ``.json`` file holding JSON.

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


def export_shared(module, path: str, target: tvm.target.Target) -> None:
    """``module.export_library(path)`` linked for the target's host: with this machine's
    compiler, or for a foreign host with ``cross_compiler(target)`` (TVM's
    ``tvm.support.ndk.create_shared``). Raises ValueError for a missing or wrong cross
    compiler, RuntimeError with the compiler's output when linking fails."""
    cc = cross_compiler(target)
    if cc is None:
        module.export_library(path)
        return
    from tvm.support import ndk
    os.environ[CROSS_CC_ENV] = cc
    module.export_library(path, fcompile=ndk.create_shared)

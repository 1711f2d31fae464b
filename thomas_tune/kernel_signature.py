"""Kernel signatures that TVM's own OpenCL runtime can launch.

On a phone an export runs inside TVM's C++ RPC server ``tvm_rpc`` with TVM's own OpenCL
runtime, not thomas_tune's sidecar. That runtime packs a kernel's scalar arguments by their
type (``GetArgConvertCode`` in TVM's ``src/runtime/pack_args.h``, the same in the pinned
wheel's copy): 32- and 64-bit signed integers, 32-bit unsigned integers, 32- and 64-bit floats
and handles (buffers, images). Anything else (``ulong``, ``half``, ``char``, ``short``,
``bool``, a vector) fails at the first launch with "Cannot handle ... as device function
argument", after the whole module has been built and sent to the device.

:func:`check_source` reads every ``__kernel`` signature of the OpenCL C that TVM's code
generator writes and raises at build time, naming the kernel and the argument. It runs on
every OpenCL module the product builds (TVM's ``tvm_callback_opencl_postproc``, installed by
:func:`register`: the check, then :mod:`.opencl_source`'s rewrite), so a kernel that the phone
could not launch is a build error everywhere, also where the sidecar (which packs more types)
would have launched it. The usual cause is a scalar that TVM's common-subexpression
elimination moved out of a kernel: an expression of a kernel parameter computed once on the
host becomes a new kernel argument of the expression's type.

The check changes no kernel, so it is no part of the code-generation version of a tuning log's
times (:mod:`thomas_tune.logs.codegen` fingerprints ``opencl_source.py``, not this module).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re

#: OpenCL C scalar types of kernel arguments that TVM's OpenCL runtime packs (int32, int64,
#: uint32, float32, float64: ``GetArgConvertCode``)
PACKED_SCALARS = frozenset({"int", "long", "uint", "float", "double"})
#: OpenCL C image types (passed as handles, as buffers are)
IMAGE_TYPES = frozenset({"image1d_t", "image1d_buffer_t", "image1d_array_t", "image2d_t",
                         "image2d_array_t", "image3d_t"})
_KERNEL = re.compile(r"__kernel\s+void\s+(\w+)\s*\(([^)]*)\)")
_QUALIFIERS = frozenset({"const", "restrict", "volatile", "__read_only", "__write_only",
                         "read_only", "write_only", "__read_write", "read_write"})


class UnlaunchableKernel(ValueError):
    """A kernel takes an argument that TVM's OpenCL runtime cannot pass."""


def signatures(source: str) -> dict[str, list[tuple[str, str]]]:
    """The ``__kernel`` functions of OpenCL C ``source``: name -> [(type, argument name), ...]
    in order; a pointer's type keeps its ``*`` and address space (``"__global float*"``)."""
    return {m.group(1): list(_arguments(m.group(2))) for m in _KERNEL.finditer(source)}


@functools.lru_cache(maxsize=4096)
def _arguments(text: str) -> tuple[tuple[str, str], ...]:
    """(type, name) of each argument of a kernel's parameter list ``text``. Kept per text: TVM's
    code generator writes a declaration of every kernel of a module into each kernel's source,
    so each parameter list comes back once per kernel of the module."""
    args = []
    for arg in (a.strip() for a in text.split(",")):
        if not arg:
            continue
        words = arg.replace("*", " * ").split()
        kept = [w for w in words[:-1] if w not in _QUALIFIERS]
        args.append((" ".join(kept).replace(" *", "*"), words[-1]))
    return tuple(args)


def unlaunchable(source: str) -> list[tuple[str, str, str]]:
    """(kernel, argument, type) of every argument of ``source``'s kernels that TVM's OpenCL
    runtime cannot pack (module docstring), in source order; empty when there is none."""
    bad = []
    for kernel, args in signatures(source).items():
        for ty, name in args:
            if "*" in ty or ty in IMAGE_TYPES:
                continue
            if ty not in PACKED_SCALARS:
                bad.append((kernel, name, ty))
    return bad


def check_source(source: str) -> str:
    """Return ``source`` (OpenCL C) unchanged when TVM's OpenCL runtime can launch each of its
    kernels; raises :class:`UnlaunchableKernel` naming the first kernel and argument it
    cannot (and how many more there are) otherwise."""
    bad = unlaunchable(source)
    if bad:
        kernel, name, ty = bad[0]
        n = len(bad) - 1
        more = f" ({n} more such argument{'s' if n > 1 else ''})" if n else ""
        raise UnlaunchableKernel(
            f"OpenCL kernel {kernel}: argument {name} is a {ty}, which TVM's OpenCL runtime "
            f"(tvm_rpc on a phone) cannot pass{more}; kernel scalars must be int, long, uint, "
            "float or double: give the kernel 32-bit parameters, or compute the value inside "
            "the kernel from them")
    return source


def _postproc(code: str, target=None) -> str:
    from . import half_source, opencl_source
    code = check_source(code)
    if not (_NATIVE_HALF[0] or os.environ.get(NATIVE_HALF_ENV) == "1"):
        code = half_source.rewrite_half_access(code)
    return opencl_source._postproc(code, target)


#: while True (:func:`native_half`), :func:`_postproc` leaves half arithmetic as it is
_NATIVE_HALF = [False]
#: the same for a whole process and the processes it starts (``tune --precision autocast16``,
#: whose candidates are built in builder processes) while this variable is "1"
NATIVE_HALF_ENV = "THOMAS_TUNE_NATIVE_HALF"


@contextlib.contextmanager
def native_half():
    """Within it, OpenCL C is post-processed without the half-storage rewrite: half arithmetic
    reaches the device's compiler, which builds it only with ``cl_khr_fp16`` (``rpc probe``
    asks the device so)."""
    _NATIVE_HALF[0] = True
    try:
        yield
    finally:
        _NATIVE_HALF[0] = False


def register() -> None:
    """Make TVM's OpenCL code generator pass each module's source through
    :func:`check_source`, then float16 buffers through ``vload_half`` / ``vstore_half``
    (:func:`thomas_tune.half_source.rewrite_half_access`: source without ``half`` unchanged),
    then :mod:`thomas_tune.opencl_source`'s rewrite (the global function
    ``tvm_callback_opencl_postproc``, in this process; replaces one registered before)."""
    import tvm

    tvm.register_global_func("tvm_callback_opencl_postproc", _postproc, override=True)

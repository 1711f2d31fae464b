"""Aligned vector access to shared memory in the OpenCL C that TVM's code generator writes.

TVM's OpenCL code generator writes every vector load and store as ``vloadN``/``vstoreN``. The
OpenCL C specification (section 6.15.7, "Vector Data Load and Store Functions") requires of
their address only the alignment of one element, so a compiler must assume a misaligned
address. NVIDIA's does: in the PTX of the H100's tuned AlexNet kernels there was no
``ld.shared.v4`` at all, every 4-wide read of shared memory became four scalar loads
(``bench/results/h100_alexnet_build_info.json``). An SM issues shared loads at a quarter of its
FMA rate, so a register-tiled matmul that reads its operands 4 at a time needs those reads to
stay 4-wide.

:func:`align_local_vectors` rewrites the source before the driver compiles it: each ``__local``
array a kernel declares is declared aligned to :data:`ALIGN` bytes, and each ``vloadN(0, a +
e)`` / ``vstoreN(v, 0, a + e)`` on such an array whose index ``e`` is provably a multiple of
``N`` becomes a dereference of a ``__local`` vector pointer, which OpenCL C requires to be
aligned to the vector's size (section 6.3.5, "Alignment of Types"), so the compiler may use
one vector instruction. An index is a multiple of ``N`` when its expression proves it
(:func:`multiple_of`): constants, sums, products, left shifts, and the integers the kernel
defines once (``int x = ...;``). Anything else (a division, a cast, a name assigned twice)
proves nothing, and the access keeps its ``vloadN``. The rewrite never changes which bytes
are read or written.

The rewrite takes about 1.3 ms per kernel of 26 KB of source (pure Python, a 2-core x86-64
host): 0.7 s for 500 such kernels in one module.

Registered as TVM's ``tvm_callback_opencl_postproc`` (:func:`register`), which the OpenCL
code generator calls with each module's source.
"""

from __future__ import annotations

import ast
import functools
import re

#: alignment of the ``__local`` arrays (bytes): that of the widest vector rewritten (float4)
ALIGN = 16
#: bytes of OpenCL C's scalar types (also what
#: :func:`thomas_tune.measure.builder.private_array_bytes`
#: counts)
SCALAR_BYTES = {"char": 1, "uchar": 1, "bool": 1, "short": 2, "ushort": 2, "half": 2, "int": 4,
                "uint": 4, "float": 4, "long": 8, "ulong": 8, "double": 8}
#: set False to compile the code generator's source as written
#: (``bench/experiments/kernel_build_info.py --time`` compares both in one process)
ENABLED = True
#: a proof of divisibility stops at this power of two (more is never needed)
_CAP = 64

_LOCAL_ARRAY = re.compile(r"__local\s+(\w+)\s+(\w+)\s*\[(\d+)\]\s*;")
_INT_DEF = re.compile(r"^[ \t]*(?:int|long|uint|ulong)\s+(\w+)\s*=\s*([^;]+);", re.M)
_WRITE = re.compile(r"(?:\+\+|--)\s*(\w+)|\b(\w+)\s*(?:(?:<<|>>|[-+*/%&|^])?=(?!=)|\+\+|--)")
_VECTOR_CALL = re.compile(r"\b(vload|vstore)(\d+)\s*\(")


def _pow2_dividing(value: int) -> int:
    """The largest power of two (at most ``_CAP``) that divides ``value``; ``_CAP`` for 0."""
    if value == 0:
        return _CAP
    m = 1
    while m < _CAP and value % (2 * m) == 0:
        m *= 2
    return m


def multiple_of(expr: str, defs: dict[str, str] | None = None) -> int:
    """The largest power of two, at most 64, that the OpenCL C integer expression ``expr``
    provably is a multiple of (1 when nothing is proven).

    ``defs`` maps names to the expressions they are defined as (each defined once, never
    assigned again: :func:`int_definitions`); other names and function calls are unknown
    (1), except ``convert_int(x)``, which is ``x``. Proven: integer constants, ``+``, ``-``
    (the smaller of the two), ``*`` (the product), ``<<`` by a constant. Not parsed, so 1:
    casts, ternaries, suffixed constants."""
    defs = defs or {}

    def walk(node: ast.AST, depth: int) -> int:
        if depth > 50:
            return 1
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return _pow2_dividing(node.value)
        if isinstance(node, ast.Name):
            if node.id in defs:
                try:
                    return walk(ast.parse(defs[node.id], mode="eval").body, depth + 1)
                except (SyntaxError, ValueError, RecursionError):
                    return 1
            return 1
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return walk(node.operand, depth + 1)
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, (ast.Add, ast.Sub)):
                return min(walk(node.left, depth + 1), walk(node.right, depth + 1))
            if isinstance(node.op, ast.Mult):
                return min(_CAP, walk(node.left, depth + 1) * walk(node.right, depth + 1))
            if (isinstance(node.op, ast.LShift) and isinstance(node.right, ast.Constant)
                    and isinstance(node.right.value, int) and 0 <= node.right.value < 32):
                return min(_CAP, walk(node.left, depth + 1) << node.right.value)
            return 1
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "convert_int" and len(node.args) == 1):
            return walk(node.args[0], depth + 1)
        return 1

    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError):  # not C this parser reads: nothing proven
        return 1
    return walk(tree.body, 0)


def int_definitions(kernel: str) -> dict[str, str]:
    """Integers that the kernel source ``kernel`` defines at the start of a line
    (``int x = ...;``) exactly once and never assigns again: name -> defining expression.
    (A ``for`` loop's counter is defined inside ``for (...)``, so it is never one of them.)"""
    found: dict[str, list[str]] = {}
    for m in _INT_DEF.finditer(kernel):
        found.setdefault(m.group(1), []).append(m.group(2))
    writes: dict[str, int] = {}  # assignments and increments of each name, definitions included
    for m in _WRITE.finditer(kernel):
        name = m.group(1) or m.group(2)
        writes[name] = writes.get(name, 0) + 1
    return {name: exprs[0] for name, exprs in found.items()
            if len(exprs) == 1 and writes.get(name) == 1}


def _call_end(src: str, open_paren: int) -> int:
    """Index of the parenthesis closing the one at ``open_paren``."""
    depth = 0
    for i in range(open_paren, len(src)):
        if src[i] == "(":
            depth += 1
        elif src[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unbalanced parentheses in OpenCL source")


def _split_args(args: str) -> list[str]:
    """``args`` split at its top-level commas."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(args):
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(args[start:i])
            start = i + 1
    out.append(args[start:])
    return out


def _rewrite_calls(src: str, arrays: dict[str, str], defs, counts: dict[str, int]) -> str:
    """``src`` with each ``vloadN``/``vstoreN`` call, innermost first, in the form
    :func:`_one_call` gives, where it gives one."""
    out, pos = [], 0
    while True:
        m = _VECTOR_CALL.search(src, pos)
        if m is None:
            out.append(src[pos:])
            return "".join(out)
        end = _call_end(src, m.end() - 1)
        inner = _rewrite_calls(src[m.end():end], arrays, defs, counts)
        out.append(src[pos:m.start()])
        out.append(_one_call(m.group(1), int(m.group(2)), _split_args(inner), arrays, defs,
                             counts) or f"{m.group(0)}{inner})")
        pos = end + 1


def _one_call(kind: str, lanes: int, args: list[str], arrays: dict[str, str], defs,
              counts: dict[str, int]) -> str | None:
    """The aligned form of one ``vloadN``/``vstoreN`` call with arguments ``args``, or None.
    ``defs()`` gives the kernel's :func:`int_definitions`, asked for only when the index
    alone proves nothing."""
    if len(args) != (2 if kind == "vload" else 3) or args[-2].strip() != "0":
        return None
    m = re.fullmatch(r"\s*(\w+)\s*\+\s*(.+?)\s*", args[-1], re.S)
    if m is None or m.group(1) not in arrays:
        return None
    name, index = m.groups()
    elem = arrays[name]
    if lanes * SCALAR_BYTES[elem] > ALIGN or (multiple_of(index) % lanes
                                              and multiple_of(index, defs()) % lanes):
        counts["kept"] += 1
        return None
    counts["aligned"] += 1
    ref = f"(*(__local {elem}{lanes}*)({name} + ({index})))"
    return ref if kind == "vload" else f"({ref} = ({args[0].strip()}))"


def align_local_vectors(source: str) -> tuple[str, dict[str, int]]:
    """``source`` (OpenCL C, one or more ``__kernel`` functions as TVM writes them) with its
    ``__local`` arrays aligned to :data:`ALIGN` bytes and each vector access of them whose
    index is provably aligned written as a vector dereference (module docstring).

    Returns the new source and counts: ``aligned`` (accesses rewritten), ``kept`` (vector
    accesses of ``__local`` arrays left as ``vloadN``/``vstoreN``: index not proven).
    Raises ValueError on unbalanced parentheses."""
    counts = {"aligned": 0, "kept": 0}
    parts = source.split("__kernel ")
    for i, kernel in enumerate(parts[1:], 1):
        arrays = {m.group(2): m.group(1) for m in _LOCAL_ARRAY.finditer(kernel)
                  if m.group(1) in SCALAR_BYTES}
        if not arrays:
            continue
        kernel = _LOCAL_ARRAY.sub(
            lambda m: (f"__local {m.group(1)} {m.group(2)}[{m.group(3)}] "
                       f"__attribute__((aligned({ALIGN})));"
                       if m.group(2) in arrays else m.group(0)), kernel)
        defs = functools.cache(functools.partial(int_definitions, kernel))
        parts[i] = _rewrite_calls(kernel, arrays, defs, counts)
    return "__kernel ".join(parts), counts


def _postproc(code: str, _target=None) -> str:
    return align_local_vectors(code)[0] if ENABLED else code


def register() -> None:
    """Make TVM's OpenCL code generator pass each module's source through
    :func:`align_local_vectors` (the global function ``tvm_callback_opencl_postproc``, in
    this process; replaces one registered before)."""
    import tvm

    tvm.register_global_func("tvm_callback_opencl_postproc", _postproc, override=True)

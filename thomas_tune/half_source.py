"""OpenCL C of float16 storage on devices without ``cl_khr_fp16`` (``--precision mixed16``).

OpenCL C without ``cl_khr_fp16`` (no device here has it) forbids loading or storing ``half``
through a pointer, but its core built-ins ``vload_half`` / ``vstore_half`` and their vector
forms ``vload_halfN`` / ``vstore_halfN`` (OpenCL C specification 3.0, section 6.15.8) read and
write float16 memory as float32 on every device: :func:`rewrite_half_access` puts them in the
source TVM writes for float16 buffers (a kernel without ``half`` is returned unchanged, so
float32 builds are byte for byte as before). The graphs that store float16 are
:mod:`thomas_tune.half_storage`'s.
"""

from __future__ import annotations

import re

from .opencl_source import _split_args  # top-level commas of a call's arguments

#: the rounding of a float32 value to float16 and back, in OpenCL C without ``cl_khr_fp16``:
#: a store to and a load from private memory (``vstore_half`` rounds to nearest even)
ROUND_HALF = "thomas_tune_round_half"
#: vector widths of ``vstore_halfN`` / ``vload_halfN`` (OpenCL C 3.0, section 6.15.8)
_WIDTHS = (2, 3, 4, 8, 16)


def _helper(width: str = "") -> str:
    """The definition of :data:`ROUND_HALF` (``width`` ""), or of its ``floatN`` form
    ``ROUND_HALF + N`` (``width`` "N"), component by component."""
    w = width
    return (f"#ifndef THOMAS_TUNE_ROUND_HALF{w}\n#define THOMAS_TUNE_ROUND_HALF{w}\ninline "
            f"float{w} {ROUND_HALF}{w}(float{w} x) {{ ushort{w} h; vstore_half{w}(x, 0, "
            f"(half*)&h); return vload_half{w}(0, (const half*)&h); }}\n#endif\n")


_DEFINITION = re.compile(r"^__kernel void \w+\([^;{]*\)\s*\{", re.M)
_FP16_BLOCK = re.compile(r"#ifdef cl_khr_fp16\n#pragma OPENCL EXTENSION cl_khr_fp16 : enable\n"
                         r"#elif defined\(cl_amd_fp16\)\n.*?#endif\n", re.S)
_HALF_WORD = re.compile(r"\bhalf\d*\b")
_HALF_PTR = re.compile(r"__global\s+half\s*\*\s*(?:restrict\s+)?(\w+)")


class HalfAccessError(ValueError):
    """OpenCL C uses float16 in a form :func:`rewrite_half_access` does not rewrite."""


def _close(src: str, i: int, open_c: str, close_c: str) -> int:
    """Index of the bracket closing the one at ``i``."""
    depth = 0
    for j in range(i, len(src)):
        if src[j] == open_c:
            depth += 1
        elif src[j] == close_c:
            depth -= 1
            if depth == 0:
                return j
    raise HalfAccessError("unbalanced brackets in OpenCL source")


def _strip_parens(e: str) -> str:
    e = e.strip()
    while e.startswith("(") and _close(e, 0, "(", ")") == len(e) - 1:
        e = e[1:-1].strip()
    return e


def _calls(src: str, name: str, make) -> str:
    """``src`` with each call ``name(arg)`` replaced by ``make(arg)`` (outermost first; calls
    nested in ``arg`` are replaced in what ``make`` returns). The search goes on from where
    the replacement starts: text before it holds no call left, so a kernel of k calls is read
    once, not k times."""
    pat = re.compile(rf"\b{name}\(")
    pos = 0
    while True:
        m = pat.search(src, pos)
        if m is None:
            return src
        end = _close(src, m.end() - 1, "(", ")")
        src = src[:m.start()] + make(src[m.end():end]) + src[end + 1:]
        pos = m.start()


def _accesses(kernel: str, ptrs: set[str]) -> str:
    """``kernel`` with each load ``p[i]`` of a float16 pointer ``p`` a ``vload_half`` and each
    store ``p[i] = e;`` a ``vstore_half``."""
    pat = re.compile(r"\b(" + "|".join(sorted(ptrs)) + r")\[")
    out, pos = [], 0
    while True:
        m = pat.search(kernel, pos)
        if m is None:
            out.append(kernel[pos:])
            return "".join(out)
        end = _close(kernel, m.end() - 1, "[", "]")
        index = _accesses(kernel[m.end():end], ptrs)
        store = re.match(r"\s*=(?!=)", kernel[end + 1:])
        out.append(kernel[pos:m.start()])
        if store:
            semi = kernel.index(";", end + 1 + store.end())
            value = _accesses(kernel[end + 1 + store.end():semi], ptrs)
            inner = _strip_parens(value)
            if inner.startswith("convert_half(") and _close(inner, 12, "(", ")") == len(inner) - 1:
                value = inner[13:-1]
            out.append(f"vstore_half({value.strip()}, {index}, {m.group(1)})")
            pos = semi
        else:
            out.append(f"vload_half({index}, {m.group(1)})")
            pos = end + 1


def _vector_accesses(kernel: str, ptrs: set[str]) -> str:
    """``kernel`` with each vector load ``vloadN(o, p + i)`` and store ``vstoreN(v, o, p + i)``
    of a float16 pointer ``p`` (TVM writes them for a vectorized copy, as a cooperative fetch
    into work-group memory) through ``vload_halfN`` / ``vstore_halfN``: floatN values, exact for
    float16 data, where OpenCL C without ``cl_khr_fp16`` has no ``halfN`` to load."""
    def on_half(arg: str) -> bool:
        return re.match(r"\(*\s*(" + "|".join(sorted(ptrs)) + r")\b", arg.strip()) is not None

    for kind, at in (("vload", 1), ("vstore", 2)):
        pat = re.compile(rf"\b{kind}(\d+)\(")
        pos = 0
        while True:
            m = pat.search(kernel, pos)
            if m is None:
                break
            end = _close(kernel, m.end() - 1, "(", ")")
            args = _split_args(kernel[m.end():end])
            if len(args) == at + 1 and on_half(args[at]):
                kernel = f"{kernel[:m.start()]}{kind}_half{m.group(1)}({kernel[m.end():]}"
            pos = m.end()
    return kernel


_LOCAL_HALF_ARRAY = re.compile(
    r"__local half (\w+)\[(\d+)\]((?:\s*__attribute__\(\(\w+\(\d+\)\)\))?);")
_HALF_VECTOR = re.compile(r"(?<![\w*])half(\d+) (\w+)(?=\s*[=;])")
_LOCAL_HALF_PTR = re.compile(r"__local half\*")
#: a private ``half`` scalar or array declaration (``half v;``, ``half t[8];``)
_HALF_PRIVATE = re.compile(r"(?<![\w*])half (\w+(?:\[\d+\])?);")
#: a rounding to float16 of a scalar or a vector (``convert_half4``: TVM writes one for a
#: vectorized epilogue whose float16 value is read back as float32 in the same kernel)
_CONVERT_HALF = re.compile(r"\bconvert_half\d*\(")
_HALF_LITERAL = re.compile(r"\(half\)(-?[0-9][0-9.]*(?:e[+-]?[0-9]+)?f?)")


def _half_locals(body: str) -> tuple[str, set[str]]:
    """A kernel ``body`` whose float16 values in work-group and private memory are held so
    that OpenCL C without ``cl_khr_fp16`` compiles them: a ``__local half`` array becomes a
    ``__local ushort`` array of the same bytes, read and written through a ``__local half*``
    of the same name (returned, for :func:`_accesses` to rewrite like a buffer); a private
    ``half`` scalar or array a ``float`` one (it holds float16 values only: what it is given
    is a load of float16 memory, a value rounded to float16 or a literal rounded to float16
    here; a private tile of a stored input is such an array), and a private ``halfN`` vector
    (TVM writes one for a vectorized epilogue, ``halfN v = convert_halfN(e);``, then stores
    its components one by one, or for a gathered copy, :func:`_vector_literals`) a ``floatN``
    given ``e`` rounded to float16."""
    names = set()

    def local(m):
        names.add(m.group(1))
        return (f"__local ushort {m.group(1)}_bits[{m.group(2)}]{m.group(3)}; __local half* "
                f"{m.group(1)} = (__local half*){m.group(1)}_bits;")
    body = _LOCAL_HALF_ARRAY.sub(local, body)
    body = _HALF_PRIVATE.sub(r"float \1;", body)
    body = _HALF_VECTOR.sub(r"float\1 \2", body)
    for n in _WIDTHS:
        body = _calls(body, f"convert_half{n}", lambda e, n=n: f"{ROUND_HALF}{n}({e})")
    body = _vector_literals(body)
    body = _HALF_LITERAL.sub(lambda m: f"{ROUND_HALF}({m.group(1)})", body)
    return body, names


_HALF_VECTOR_LITERAL = re.compile(r"\(half(\d+)\)\(")


def _vector_literals(body: str) -> str:
    """``body`` with each vector literal ``(halfN)(a, b, ...)`` (TVM writes one for a
    vectorized copy whose elements are gathered, ``halfN v = (halfN)(x[i.s0], x[i.s1]);``) a
    ``floatN`` of the same components rounded to float16 (exact for float16 data)."""
    while True:
        m = _HALF_VECTOR_LITERAL.search(body)
        if m is None:
            return body
        n, end = m.group(1), _close(body, m.end() - 1, "(", ")")
        body = (f"{body[:m.start()]}{ROUND_HALF}{n}((float{n})({body[m.end():end]}))"
                f"{body[end + 1:]}")


def rewrite_half_access(source: str) -> str:
    """``source`` (OpenCL C as TVM writes it) with its float16 buffers read and written through
    ``vload_half`` / ``vstore_half`` and every other float16 value held in a float (module
    docstring; a ``halfN`` value in a ``floatN``, rounded by ``vstore_halfN`` / ``vload_halfN``
    through private memory): loads ``p[i]`` -> ``vload_half(i, p)``, stores ``p[i] =
    convert_half(e);`` -> ``vstore_half(e, i, p);``, a rounding ``convert_half(e)`` elsewhere
    -> a float with ``e``'s float16 value (:data:`ROUND_HALF`); vector loads and stores ``vloadN`` /
    ``vstoreN`` of float16 memory -> ``vload_halfN`` / ``vstore_halfN``; the ``cl_khr_fp16``
    block that fails to compile without the extension becomes a plain ``#ifdef``. Source
    without ``half`` (neither a float16 type nor a rounding to it) is returned as it is.
    Raises :class:`HalfAccessError` naming the kernel where ``half`` is left in another form
    (a ``halfN`` cast or parameter)."""
    if not (_HALF_WORD.search(source) or _CONVERT_HALF.search(source)):
        return source
    source = _FP16_BLOCK.sub("#ifdef cl_khr_fp16\n#pragma OPENCL EXTENSION cl_khr_fp16 : "
                             "enable\n#endif\n", source)
    parts = source.split("__kernel ")
    for i, kernel in enumerate(parts[1:], 1):
        body_at = kernel.find("{")
        if body_at < 0:  # a declaration (TVM declares every kernel of the module in each section)
            continue
        head = kernel[:body_at]
        ptrs = set(_HALF_PTR.findall(head))
        if not (ptrs or "convert_half" in kernel or _HALF_WORD.search(kernel[body_at:])):
            continue
        body, local = _half_locals(kernel[body_at:])
        ptrs |= local
        body = _accesses(_vector_accesses(body, ptrs), ptrs) if ptrs else body
        body = _calls(body, "convert_half", lambda e: f"{ROUND_HALF}({e})")
        left = [w for w in _HALF_WORD.findall(_LOCAL_HALF_PTR.sub("", body))]
        if left:
            name = head.split("(")[0].split()[-1]
            raise HalfAccessError(f"OpenCL kernel {name}: float16 used as {left[0]!r}, which "
                                  "OpenCL C without cl_khr_fp16 cannot compile and thomas_tune "
                                  "does not rewrite; build this graph with --precision float32")
        parts[i] = head + body
    # the helper in each section (TVM's OpenCL runtime builds each "// Function: " section as
    # a program of its own), before the definition of the kernel that uses it
    sections = "__kernel ".join(parts).split("// Function: ")
    for i, sec in enumerate(sections):
        m = _DEFINITION.search(sec)
        if m is not None and ROUND_HALF in sec[m.start():]:
            used = [w for w in ("",) + tuple(map(str, _WIDTHS))
                    if f"{ROUND_HALF}{w}(" in sec[m.start():]]
            sections[i] = sec[:m.start()] + "".join(map(_helper, used)) + sec[m.start():]
    return "// Function: ".join(sections)

"""Sizes of the kernels in a cubin, read from its ELF section table (no CUDA tool needed).

A kernel's code is the ELF64 section ``.text.<kernel>``; on sm_70 and later every SASS
instruction is 16 bytes, so its size over 16 is the kernel's static instruction count.  That
count matters where a kernel runs each instruction about once: a grid of at most one wave
whose code has no loops fetches all of it cold in a run, which its timing alone, from warm
instruction caches, never shows (docs/codegen.md, "Exact-fp32 attention from a cold
instruction cache").
"""

from __future__ import annotations

import struct

#: Bytes of one SASS instruction on every architecture from Volta on.
INSTRUCTION_BYTES = 16
_TEXT = ".text."


def text_instructions(cubin: bytes) -> dict[str, int]:
    """Each kernel's static SASS instruction count in ``cubin`` (an ELF64 image), by name."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    # (name offset, type, flags, address, file offset, size) of each section header
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(header: tuple[int, ...]) -> str:
        start = names_at + header[0]
        return cubin[start : cubin.index(b"\0", start)].decode()

    return {name(h)[len(_TEXT) :]: h[5] // INSTRUCTION_BYTES for h in headers if name(h).startswith(_TEXT)}

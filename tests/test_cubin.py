"""welder.device.cubin: kernel sizes from a cubin's ELF section table."""

from __future__ import annotations

import shutil
import struct

import pytest

from welder.device.cubin import text_instructions
from welder.device.gpu import CompileError, compile_cubin, compile_ptx


def elf64(sections: dict[str, bytes]) -> bytes:
    """A minimal little-endian ELF64 image holding ``sections`` (and the null section and the
    section-name table that every ELF has), built field by field from the ELF64 layout."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in (".shstrtab", *sections))
    name_at = {n: names.index(b"\0" + n.encode() + b"\0") + 1 for n in (".shstrtab", *sections)}
    body, offsets = b"", {}
    for n, data in {".shstrtab": names, **sections}.items():
        offsets[n] = 64 + len(body)
        body += data
    shoff = 64 + len(body)
    headers = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]
    for n, data in {".shstrtab": names, **sections}.items():
        kind = 3 if n == ".shstrtab" else 1
        headers.append(struct.pack("<IIQQQQIIQQ", name_at[n], kind, 0, 0, offsets[n], len(data), 0, 0, 1, 0))
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 1, 190, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(headers), 1)
    assert len(header) == 64
    return header + body + b"".join(headers)


def test_each_kernel_is_its_text_section_in_16_byte_instructions() -> None:
    image = elf64(
        {
            ".text.welder_k0": bytes(16 * 10),
            ".nv.info.welder_k0": bytes(24),
            ".text.other": bytes(16 * 3),
            ".rela.text.other": bytes(48),
        }
    )
    assert text_instructions(image) == {"welder_k0": 10, "other": 3}


def test_what_is_not_an_elf64_image_is_refused() -> None:
    with pytest.raises(ValueError, match="not an ELF64 cubin"):
        text_instructions(b"// PTX text, not a cubin")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_s_cubin_and_ptx_of_one_source_name_the_same_kernels() -> None:
    """A real cubin: one .text section a kernel, a whole number of instructions, and the
    PTX of the same source enters the same kernels; what nvcc refuses is a CompileError."""
    source = 'extern "C" __global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }\n'
    source += 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'
    sizes = text_instructions(compile_cubin(source, "sm_90"))
    assert sorted(sizes) == ["add_one", "twice"] and all(0 < n < 64 for n in sizes.values())
    ptx = compile_ptx(source, "sm_90")
    assert ".visible .entry add_one(" in ptx and ".visible .entry twice(" in ptx
    with pytest.raises(CompileError, match="nvcc failed"):
        compile_ptx("this is not CUDA", "sm_90")
    with pytest.raises(CompileError, match="not an nvcc architecture"):
        compile_ptx(source, "ampere")

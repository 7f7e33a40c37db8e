"""The tensor-map kernel argument (welder/codegen/tensor_map.py) and how the device layers carry
it, without a GPU: the rules a map must meet, how a launch passes it (128 bytes at a 64-byte
aligned address, by pointer), encoding once per rotated set of buffers, the errors, and a
generated-kernel-shaped launch on the emulator through EmulatedModel (the path the tuner's checks
take).
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from welder.codegen.common import Kernel, KernelParam
from welder.codegen.tensor_map import (
    EncodedTensorMap,
    TensorMapArg,
    TensorMapError,
    check_tensor_map,
    tensor_map_problem,
)
from welder.device import gpu
from welder.runtime import emu

MAP = TensorMapArg(pointer=0, elem_bytes=2, dims=(64, 100), strides=(160,), box=(64, 32), swizzle=128)


def fake_encoder(calls: list):
    """An encoder that records its calls and returns bytes naming the base address."""

    def encode(spec: TensorMapArg, base: int) -> bytes:
        calls.append((spec, base))
        return base.to_bytes(8, "little") * 16

    return encode


def fake_buffer(address: int, nbytes: int) -> gpu.DeviceBuffer:
    """A DeviceBuffer standing for device memory at `address` (no driver needed)."""
    buffer = object.__new__(gpu.DeviceBuffer)
    buffer.nbytes = nbytes
    buffer._alloc = address
    return buffer


def test_sizes_of_a_map():
    assert MAP.rank == 2
    assert MAP.box_bytes == 64 * 32 * 2
    assert MAP.extent == 99 * 160 + 63 * 2 + 2  # the last element's end


def test_the_rules_name_what_is_wrong():
    check_tensor_map(MAP, 0x1000)
    assert tensor_map_problem(MAP, 0x1000) is None
    with pytest.raises(TensorMapError, match=r"map A: the global address 0x1008 must be 16-byte aligned"):
        check_tensor_map(MAP, 0x1008, "map A")
    short = TensorMapArg(0, 2, (64, 100), (), (64, 32), 0)
    assert "needs 2 box dimensions and 1 strides, got 2 and 0" in tensor_map_problem(short, 0)
    with pytest.raises(TensorMapError, match="128 bytes, not 64"):
        EncodedTensorMap(bytes(64))


def read(address: int, nbytes: int) -> bytes:
    return ctypes.string_at(address, nbytes)


def test_a_launch_passes_each_value_by_pointer_and_maps_64_aligned():
    calls: list = []
    args = [0x7F0000001000, np.int32(5), MAP, np.float32(2.5), fake_buffer(0x2000, 64)]
    holders, params = gpu.kernel_params(args, fake_encoder(calls))
    assert calls == [(MAP, 0x7F0000001000)]
    assert len(holders) == 5
    assert read(params[0], 8) == (0x7F0000001000).to_bytes(8, "little")
    assert read(params[1], 4) == np.int32(5).tobytes()
    assert params[2] % 64 == 0
    assert read(params[2], 128) == (0x7F0000001000).to_bytes(8, "little") * 16
    assert read(params[3], 4) == np.float32(2.5).tobytes()
    assert read(params[4], 8) == (0x2000).to_bytes(8, "little")
    # Launches without maps keep pycuda's packed format.
    assert gpu._pack([0x1000, np.int32(1), np.float16(1)]) == ("Pie", [0x1000, np.int32(1), np.float16(1)])
    with pytest.raises(TypeError, match="numpy scalars, not <class"):
        gpu._pack([0x1000, MAP])


def test_maps_are_encoded_once_per_rotated_set_over_its_own_buffer():
    calls: list = []
    sets = [[fake_buffer(0x1000 * (i + 1), MAP.extent), np.int32(7), MAP] for i in range(3)]
    bound = [gpu.bind_tensor_maps(s, fake_encoder(calls)) for s in sets]
    assert [base for _, base in calls] == [0x1000, 0x2000, 0x3000]
    for i, b in enumerate(bound):
        assert isinstance(b[2], gpu.EncodedTensorMap) and b[1] == np.int32(7) and b[0] is sets[i][0]
        assert b[2].data[:8] == (0x1000 * (i + 1)).to_bytes(8, "little")
        # An encoded map is passed as it is: no second encode.
        _, params = gpu.kernel_params(b, fake_encoder(calls))
        assert read(params[2], 128) == b[2].data
    assert len(calls) == 3


def test_a_map_over_a_small_buffer_or_a_scalar_is_refused():
    expected = r"argument 1 \(tensor map\) covers 15968 bytes, but its buffer, argument 0, has 1000"
    with pytest.raises(TensorMapError, match=expected):
        gpu.bind_tensor_maps([fake_buffer(0x1000, 1000), MAP], fake_encoder([]))
    over_scalar = TensorMapArg(1, 2, (64,), (), (8,), 0)
    with pytest.raises(TensorMapError, match="names argument 1, which is not a buffer or pointer"):
        gpu.kernel_params([0x1000, np.int32(3), over_scalar], fake_encoder([]))


def test_the_driver_encode_checks_the_rules_first():
    # No driver is touched for a map the rules refuse.
    with pytest.raises(TensorMapError, match="swizzle span"):
        gpu.encode_tensor_map(TensorMapArg(0, 4, (64, 4), (256,), (64, 4), 128), 0x1000)


def test_encode_failures_cross_the_worker_as_themselves():
    error = gpu._rebuild_error("TensorMapError", "tensor map: bad", False)
    assert isinstance(error, TensorMapError) and str(error) == "tensor map: bad"


def test_launch_specs_carry_the_kernels_maps():
    kernel = SimpleNamespace(name="k", grid=3, threads=128, smem_bytes=1024, tensor_maps=[MAP])
    assert gpu.launch_spec(kernel).tensor_maps == (MAP,)
    plain = SimpleNamespace(name="k", grid=3, threads=128, smem_bytes=1024)
    assert gpu.launch_spec(plain).tensor_maps == ()


@pytest.mark.skipif(not emu.available(), reason="kernel emulation needs Linux and g++")
def test_an_emulated_model_passes_a_kernels_tensor_maps():
    from tma_reference import UNITS

    from welder.runtime.emulate import EmulatedModel

    params = [
        KernelParam("p0", "x", "float32", (20, 44), False),
        KernelParam("p1", "y", "float32", (20, 44), True),
    ]
    spec = TensorMapArg(0, 4, (44, 20), (176,), (32, 8), 0)
    kernel = Kernel("tma_tile_copy", UNITS.read_text(), params, (2, 3), 64, 2048, "x", True, [spec])
    graph = SimpleNamespace(constants={}, outputs=["y"])
    x = np.random.default_rng(3).standard_normal((20, 44)).astype(np.float32)
    y = EmulatedModel(graph, [kernel]).run({"x": x})["y"]
    np.testing.assert_array_equal(y, x)

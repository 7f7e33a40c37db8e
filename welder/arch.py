"""GPU descriptions that drive the cost model and the limits every config must obey.

Numbers are the vendor's published figures (whitepapers and the CUDA programming guide's
per-compute-capability tables); each entry names its source.  L2 bandwidth is not
published per product; ``l2_bw_gbs`` is a conservative estimate of about two to two and a
half times the DRAM bandwidth, in line with micro-benchmark reports for these parts;
on Hopper it is set above what our own TMA-fed product kernels were measured drawing from
the L2 on an H100 (8.2 TB/s sustained; docs/tensor_cores.md).
Shared-memory bandwidth is derived as 32 banks x 4 bytes per clock per SM at the boost
clock.  ``auto`` reads the local GPU and picks the matching description.

``memory_bytes`` is the device memory of the product's largest model (V100 32 GB, A100
80 GB, H200 141 GB): ``welder tune`` refuses a tensor larger than it; ``auto`` through
pycuda reads the actual size from the driver.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field, replace

from welder.errors import WelderError


@dataclass(frozen=True)
class Arch:
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    smem_per_block: int  # bytes a block may opt into
    smem_per_sm: int
    regs_per_sm: int
    max_regs_per_thread: int
    max_threads_per_block: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    sm_partitions: int  # warp schedulers per SM
    clock_ghz: float  # boost clock
    global_bw_gbs: float  # DRAM bandwidth, GB/s
    l2_bytes: int
    l2_bw_gbs: float  # aggregate L2 read bandwidth (estimated: see ``source``)
    fp32_tflops: float
    fp16_tc_tflops: float  # dense tensor-core throughput with fp32 accumulation
    tf32_tc_tflops: float
    memory_bytes: int  # device memory: the largest model of the product unless read from the GPU
    tensor_core_shapes: dict[str, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    warp_size: int = 32
    read_transaction: int = 32  # DRAM sector size in bytes
    write_transaction: int = 32
    smem_banks: int = 32
    source: str = ""

    @property
    def sm_arch(self) -> str:
        """nvcc's name for it, e.g. ``sm_90``."""
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"

    @property
    def smem_bw_gbs(self) -> float:
        return self.smem_banks * 4 * self.clock_ghz * self.sm_count

    def to_json(self) -> dict:
        d = asdict(self)
        d["tensor_core_shapes"] = {k: [list(s) for s in v] for k, v in self.tensor_core_shapes.items()}
        return d


_VOLTA_TC = {"float16": ((16, 16, 16), (32, 8, 16), (8, 32, 16))}
_AMPERE_TC = {"float16": ((16, 16, 16), (32, 8, 16), (8, 32, 16)), "tf32": ((16, 16, 8),)}

ARCHS: dict[str, Arch] = {
    "V100": Arch(
        "V100",
        (7, 0),
        sm_count=80,
        smem_per_block=96 * 1024,
        smem_per_sm=96 * 1024,
        regs_per_sm=65536,
        max_regs_per_thread=255,
        max_threads_per_block=1024,
        max_threads_per_sm=2048,
        max_blocks_per_sm=32,
        sm_partitions=4,
        clock_ghz=1.53,
        global_bw_gbs=900,
        l2_bytes=6 * 2**20,
        l2_bw_gbs=2500,
        fp32_tflops=15.7,
        fp16_tc_tflops=125,
        tf32_tc_tflops=0.0,
        memory_bytes=32 * 2**30,
        tensor_core_shapes=_VOLTA_TC,
        source="NVIDIA Tesla V100 GPU Architecture whitepaper (2017), SXM2; CUDA C++ Programming "
        "Guide, compute capability 7.0 limits",
    ),
    "A100": Arch(
        "A100",
        (8, 0),
        sm_count=108,
        smem_per_block=163 * 1024,
        smem_per_sm=164 * 1024,
        regs_per_sm=65536,
        max_regs_per_thread=255,
        max_threads_per_block=1024,
        max_threads_per_sm=2048,
        max_blocks_per_sm=32,
        sm_partitions=4,
        clock_ghz=1.41,
        global_bw_gbs=1555,
        l2_bytes=40 * 2**20,
        l2_bw_gbs=5000,
        fp32_tflops=19.5,
        fp16_tc_tflops=312,
        tf32_tc_tflops=156,
        memory_bytes=80 * 2**30,
        tensor_core_shapes=_AMPERE_TC,
        source="NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020), SXM4 40 GB; CUDA C++ "
        "Programming Guide, compute capability 8.0 limits",
    ),
    "RTX3090": Arch(
        "RTX3090",
        (8, 6),
        sm_count=82,
        smem_per_block=99 * 1024,
        smem_per_sm=100 * 1024,
        regs_per_sm=65536,
        max_regs_per_thread=255,
        max_threads_per_block=1024,
        max_threads_per_sm=1536,
        max_blocks_per_sm=16,
        sm_partitions=4,
        clock_ghz=1.695,
        global_bw_gbs=936,
        l2_bytes=6 * 2**20,
        l2_bw_gbs=2000,
        fp32_tflops=35.6,
        fp16_tc_tflops=71,
        tf32_tc_tflops=35.6,
        memory_bytes=24 * 2**30,
        tensor_core_shapes=_AMPERE_TC,
        source="NVIDIA Ampere GA102 GPU Architecture whitepaper (2020), GeForce RTX 3090; CUDA C++ "
        "Programming Guide, compute capability 8.6 limits",
    ),
    "RTX4090": Arch(
        "RTX4090",
        (8, 9),
        sm_count=128,
        smem_per_block=99 * 1024,
        smem_per_sm=100 * 1024,
        regs_per_sm=65536,
        max_regs_per_thread=255,
        max_threads_per_block=1024,
        max_threads_per_sm=1536,
        max_blocks_per_sm=24,
        sm_partitions=4,
        clock_ghz=2.52,
        global_bw_gbs=1008,
        l2_bytes=72 * 2**20,
        l2_bw_gbs=3500,
        fp32_tflops=82.6,
        fp16_tc_tflops=165,
        tf32_tc_tflops=82.6,
        memory_bytes=24 * 2**30,
        tensor_core_shapes=_AMPERE_TC,
        source="NVIDIA Ada GPU Architecture whitepaper (2022), GeForce RTX 4090; CUDA C++ "
        "Programming Guide, compute capability 8.9 limits",
    ),
    "H100": Arch(
        "H100",
        (9, 0),
        sm_count=132,
        smem_per_block=227 * 1024,
        smem_per_sm=228 * 1024,
        regs_per_sm=65536,
        max_regs_per_thread=255,
        max_threads_per_block=1024,
        max_threads_per_sm=2048,
        max_blocks_per_sm=32,
        sm_partitions=4,
        clock_ghz=1.98,
        global_bw_gbs=3350,
        l2_bytes=50 * 2**20,
        l2_bw_gbs=9000,
        fp32_tflops=67,
        fp16_tc_tflops=989,
        tf32_tc_tflops=494,
        memory_bytes=80 * 2**30,
        tensor_core_shapes=_AMPERE_TC,
        source="NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022) and datasheet, SXM5 80 GB; "
        "CUDA C++ Programming Guide, compute capability 9.0 limits",
    ),
    "H200": Arch(
        "H200",
        (9, 0),
        sm_count=132,
        smem_per_block=227 * 1024,
        smem_per_sm=228 * 1024,
        regs_per_sm=65536,
        max_regs_per_thread=255,
        max_threads_per_block=1024,
        max_threads_per_sm=2048,
        max_blocks_per_sm=32,
        sm_partitions=4,
        clock_ghz=1.98,
        global_bw_gbs=4800,
        l2_bytes=60 * 2**20,
        l2_bw_gbs=9000,
        fp32_tflops=67,
        fp16_tc_tflops=989,
        tf32_tc_tflops=494,
        memory_bytes=141 * 10**9,
        tensor_core_shapes=_AMPERE_TC,
        source="NVIDIA H200 Tensor Core GPU datasheet (2024), SXM 141 GB (same SM as H100); L2 size "
        "as reported by the CUDA driver on the device machine",
    ),
}

_ALIASES = {"RTX_3090": "RTX3090", "RTX_4090": "RTX4090", "3090": "RTX3090", "4090": "RTX4090"}


def get_arch(name: str) -> Arch:
    """An Arch by name (case-insensitive), or ``auto`` for the local GPU."""
    if name.lower() == "auto":
        return detect_local_arch()
    key = _ALIASES.get(name.upper(), name.upper())
    if key not in ARCHS:
        raise WelderError(f"unknown arch {name!r}; choose one of {', '.join(ARCHS)} or auto")
    return ARCHS[key]


def detect_local_arch() -> Arch:
    """Describe the GPU of this machine: through pycuda if installed, else nvidia-smi."""
    reasons = []
    try:
        return _from_pycuda()
    except ImportError:
        reasons.append("pycuda is not installed (pip install welder[gpu])")
    except Exception as e:  # driver errors surface as pycuda._driver.Error
        reasons.append(f"pycuda could not query a GPU ({e})")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        reasons.append("nvidia-smi is not on PATH")
    else:
        try:
            out = (
                subprocess.run(
                    [smi, "--query-gpu=name", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                    check=True,
                )
                .stdout.strip()
                .splitlines()
            )
            if out:
                return match_gpu_name(out[0])
            reasons.append("nvidia-smi lists no GPU")
        except (subprocess.SubprocessError, OSError) as e:
            reasons.append(f"nvidia-smi failed ({e})")
    raise WelderError(
        "--arch auto cannot read the local GPU: "
        + "; ".join(reasons)
        + f". Name the target instead: --arch {' | '.join(ARCHS)}"
    )


def match_gpu_name(gpu_name: str, sm_count: int | None = None, memory_bytes: int | None = None) -> Arch:
    """The description whose name appears in a driver-reported GPU name, e.g.
    'NVIDIA H100 80GB HBM3' -> H100; the SM count and memory size, when known, override
    ours (PCIe variants have fewer SMs than SXM, and many products come in two sizes)."""
    compact = re.sub(r"[\s_-]", "", gpu_name.upper())
    for key in ("H200", "H100", "A100", "V100", "RTX4090", "RTX3090"):
        if key in compact:
            arch = ARCHS[key]
            if sm_count and sm_count != arch.sm_count:
                arch = replace(arch, sm_count=sm_count)
            if memory_bytes and memory_bytes != arch.memory_bytes:
                arch = replace(arch, memory_bytes=memory_bytes)
            return arch
    raise WelderError(f"GPU {gpu_name!r} has no description in welder.arch; pass --arch explicitly")


def _from_pycuda() -> Arch:
    import pycuda.driver as drv

    drv.init()
    dev = drv.Device(0)
    attrs = dev.get_attributes()
    sm = attrs[drv.device_attribute.MULTIPROCESSOR_COUNT]
    return match_gpu_name(dev.name(), sm, dev.total_memory())

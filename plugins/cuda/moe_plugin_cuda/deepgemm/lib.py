"""DeepGEMM's SM90 grouped GEMMs, FP8 block-scaled and bf16 (``csrc/deepgemm_grouped.cu``): find, build, load.

The kernels are DeepGEMM's: ``sm90_fp8_gemm_1d2d_impl`` (a persistent, warp-specialized FP8 GEMM that
promotes each 128-wide K block's partial sums with both scales in registers) and ``sm90_bf16_gemm_impl``
(the same structure on bf16 operands, fp32 accumulation); the headers come from
the ``sgl-deep-gemm`` wheel (or ``$DEEPGEMM_INCLUDE``), of which nothing else is used: its own torch
extension is built for one torch version. Our launcher builds the TMA descriptors and runs it as an
M-grouped GEMM over experts' rows (the "psum layout"), behind a plain C ABI, compiled with nvcc at
first use (``nvcc_build``); ``$MOE_CUDA_DEEPGEMM_LIB`` names a prebuilt library instead.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Optional

from moe_plugin_cuda import nvcc_build
from moe_plugin_cuda.nvcc_build import nvcc

SOURCE = Path(__file__).parent / "csrc" / "deepgemm_grouped.cu"
# The kernels the source instantiates, by index (keep in step with its kFp8Variants / kBf16Variants):
# (BLOCK_N, stages, TMA multicast of two CTAs: "1" none, "B" weight tiles to two row tiles, "A" row tiles
# to two column tiles). BLOCK_M is 128 in all. The tuned table picks GEMM1's and GEMM2's, per T.
FP8_VARIANTS = ((128, 5, "1"), (128, 5, "B"), (144, 5, "B"), (160, 5, "B"), (192, 4, "B"), (128, 5, "A"),
                (160, 5, "A"), (192, 4, "A"))
# the fastest pair on qwen3-235b/deepseek/qwen3-30b at T=16384 on the H100 (docs/decisions.md, "The CUDA plugin's
# measured defaults")
DEFAULT_FP8_VARIANTS = (4, 3)
BF16_VARIANTS = ((128, 6, "1"), (128, 6, "B"), (160, 5, "B"), (192, 4, "B"), (256, 3, "B"), (128, 6, "A"),
                 (192, 4, "A"), (256, 3, "A"))
DEFAULT_BF16_VARIANTS = (3, 3)
ROW_ALIGN = 128  # each expert's rows start on a multiple of BLOCK_M
MAX_EXPERTS = 1024


def runnable(variant: int, n: int, variants=FP8_VARIANTS) -> bool:
    """Whether ``variant`` (of ``variants``) runs for N = ``n`` columns: a multicast kernel pairs
    consecutive tiles into a 2-CTA cluster, and with an odd number of column tiles a pair straddles two
    experts and hangs."""
    block_n, _, multicast = variants[variant]
    return multicast == "1" or -(-n // block_n) % 2 == 0


def include_dir() -> Optional[Path]:
    """DeepGEMM's headers (``deep_gemm/``, with the CuTe/CUTLASS copy it was written against)."""
    return nvcc_build.headers("DEEPGEMM_INCLUDE", "sgl-deep-gemm", "deep_gemm/include",
                              "deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh")


def missing() -> Optional[str]:
    """Why the library can be neither loaded nor built here (None: it can)."""
    return nvcc_build.missing("MOE_CUDA_DEEPGEMM_LIB", include_dir(),
                              "no DeepGEMM headers (pip install 'moe-plugin-cuda[deepgemm]', or set DEEPGEMM_INCLUDE)",
                              nvcc())


def where() -> str:
    """Where the library comes from (for ``moe-core backends``), without building it."""
    return nvcc_build.where("MOE_CUDA_DEEPGEMM_LIB", SOURCE, include_dir())


def grid_size(num_sms: int) -> int:
    """The persistent grid for a GPU of ``num_sms`` SMs: even, as 2-CTA clusters must tile it (a MIG
    slice may have an odd count; one SM then idles)."""
    return num_sms - num_sms % 2


@functools.cache
def library(num_sms: int) -> ctypes.CDLL:
    """The loaded library for a GPU with ``num_sms`` SMs (the persistent grid is compiled in)."""
    num_sms = grid_size(num_sms)
    out, build = None, None
    if not os.environ.get("MOE_CUDA_DEEPGEMM_LIB"):
        why = missing()
        if why:
            raise RuntimeError(f"the DeepGEMM kernels cannot run: {why}")
        inc, compiler = include_dir(), nvcc()
        flags = ["-O3", "-std=c++20", "-gencode", "arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
                 "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", "-DNDEBUG", f"-DMOE_DG_NUM_SMS={num_sms}",
                 f"-I{inc}"]
        out = nvcc_build.cache_path(SOURCE, inc / "deep_gemm" / "impls" / "sm90_fp8_gemm_1d2d.cuh", compiler,
                                    f"libmoe_deepgemm_sm{num_sms}.so")
        jobs = ([("api", [])] + [(f"fp8_{k}", [f"-DMOE_DG_FP8_ONLY={k}"]) for k in range(len(FP8_VARIANTS))]
                + [(f"bf16_{k}", [f"-DMOE_DG_BF16_ONLY={k}"]) for k in range(len(BF16_VARIANTS))])
        build = functools.partial(nvcc_build.build, source=SOURCE, compiler=compiler, flags=flags, jobs=jobs,
                                  arch="-arch=sm_90a", mem_per_job=1 << 30)
    lib = nvcc_build.load("MOE_CUDA_DEEPGEMM_LIB", out, build)
    vp, u32 = ctypes.c_void_p, ctypes.c_uint32
    lib.moe_dg_last_error.restype = ctypes.c_char_p
    lib.moe_dg_fp8_grouped_gemm.argtypes = [ctypes.c_int, vp, vp, vp, vp, vp, vp, u32, u32, u32, u32, vp]
    lib.moe_dg_fp8_grouped_gemm.restype = ctypes.c_int
    lib.moe_dg_bf16_grouped_gemm.argtypes = [ctypes.c_int, vp, vp, vp, vp, u32, u32, u32, u32, vp]
    lib.moe_dg_bf16_grouped_gemm.restype = ctypes.c_int
    path = os.environ.get("MOE_CUDA_DEEPGEMM_LIB") or str(out)
    have = (lib.moe_dg_num_fp8_variants(), lib.moe_dg_num_bf16_variants(), lib.moe_dg_num_sms())
    if have != (len(FP8_VARIANTS), len(BF16_VARIANTS), num_sms):
        raise RuntimeError(f"{path} has {have[0]} FP8 and {have[1]} bf16 kernel variants for {have[2]} SMs, this "
                           f"GPU needs {len(FP8_VARIANTS)} and {len(BF16_VARIANTS)} for a grid of {num_sms}: rebuild "
                           f"it from {SOURCE.name}")
    return lib

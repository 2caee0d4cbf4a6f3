"""The CUTLASS grouped GEMMs, FP8 block-scaled and bf16 (``csrc/cutlass_grouped.cu``): find, build, load.

The library is compiled with nvcc at first use, against the CUTLASS headers of the
``nvidia-cutlass`` wheel (or ``$CUTLASS_DIR``), into a per-user cache keyed by the source, the
headers and nvcc; ``$MOE_CUDA_CUTLASS_LIB`` names a prebuilt library instead. It has a plain C ABI
(no torch headers, so no torch ABI to match) and links the CUDA runtime statically.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Optional

from moe_plugin_cuda import nvcc_build
from moe_plugin_cuda.nvcc_build import nvcc

SOURCE = Path(__file__).parent / "csrc" / "cutlass_grouped.cu"
# The kernels the source instantiates, by index: (operands' dtype, schedule and tile, cluster, D's dtype). Each
# compiles as its own object, in parallel. FP8: GEMM1 an fp32-D or bf16-D one (the pipeline allocates D as the
# kernel writes it), GEMM2 a bf16-D one; bf16: GEMM1 a bf16-D one or a "swiglu" one (its epilogue writes
# silu(gate) * up in bf16, N/2 columns, from gate/up-interleaved weights), GEMM2 a bf16-D one; the tuned table
# picks which, per T.
VARIANTS = (("fp8", "coop 128x128x128", "1x1", "bf16"), ("fp8", "coop 128x128x128", "1x1", "fp32"),
            ("fp8", "ping 64x128x128", "1x1", "bf16"), ("fp8", "coop 128x128x128", "1x2", "bf16"),
            ("fp8", "ping 64x128x128", "1x1", "fp32"), ("fp8", "coop 128x128x128", "2x1", "bf16"),
            ("fp8", "coop 128x128x128", "2x1", "fp32"), ("fp8", "ping 64x128x128", "2x1", "fp32"),
            ("fp8", "ping 64x128x128", "2x1", "bf16"), ("bf16", "coop 128x256x64", "1x1", "bf16"),
            ("bf16", "ping 64x256x64", "1x1", "bf16"), ("bf16", "coop 128x256x64", "2x1", "bf16"),
            ("bf16", "coop 128x128x64", "1x1", "bf16"), ("bf16", "coop 128x256x64", "1x1", "swiglu"),
            ("bf16", "ping 64x256x64", "1x1", "swiglu"))
# (GEMM1, GEMM2) without a tuned choice: FP8 the cooperative 128x128 kernels; bf16 the kernels a probe measured
# fastest on ~256-row experts (cooperative 128x256, ping-pong 64x256; docs/decisions.md, "The CUDA plugin's
# measured defaults")
DEFAULT_VARIANTS = {"fp8": (1, 0), "bf16": (9, 10)}


def variants_for(operands: str, output: str) -> list[int]:
    """The variants reading ``operands`` ("fp8" or "bf16") and writing D in ``output`` ("bf16", "fp32" or
    "swiglu")."""
    return [k for k, v in enumerate(VARIANTS) if v[0] == operands and v[3] == output]


def cutlass_dir() -> Optional[Path]:
    """CUTLASS source root (``include/``, ``tools/util/include/``): ``$CUTLASS_DIR`` or the wheel's copy."""
    return nvcc_build.headers("CUTLASS_DIR", "nvidia-cutlass", "cutlass_library/source", "include/cutlass")


def missing() -> Optional[str]:
    """Why the library can be neither loaded nor built here (None: it can)."""
    return nvcc_build.missing("MOE_CUDA_CUTLASS_LIB", cutlass_dir(),
                              "no CUTLASS headers (pip install 'moe-plugin-cuda[cutlass]', or set CUTLASS_DIR)", nvcc())


def where() -> str:
    """Where the library comes from (for ``moe-core backends``), without building it."""
    return nvcc_build.where("MOE_CUDA_CUTLASS_LIB", SOURCE, cutlass_dir())


def _flags(cdir: Path) -> list[str]:
    return ["-O3", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
            "-Xcompiler", "-fvisibility=hidden", "-DNDEBUG", f"-I{cdir / 'include'}", f"-I{cdir / 'tools/util/include'}"]


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded library (built first if needed, one object per variant plus the API object)."""
    out, build = None, None
    if not os.environ.get("MOE_CUDA_CUTLASS_LIB"):
        why = missing()
        if why:
            raise RuntimeError(f"the cutlass experts cannot run: {why}")
        cdir, compiler = cutlass_dir(), nvcc()
        out = nvcc_build.cache_path(SOURCE, cdir / "include" / "cutlass" / "version.h", compiler,
                                    "libmoe_cutlass.so")
        jobs = [("api", ["-DMOE_VARIANT_MASK=0"])] + [(f"v{k}", [f"-DMOE_VARIANT_MASK={1 << k}", "-DMOE_NO_API"])
                                                       for k in range(len(VARIANTS))]
        build = functools.partial(nvcc_build.build, source=SOURCE, compiler=compiler, flags=_flags(cdir), jobs=jobs,
                                  arch="-arch=sm_90a")
    lib = nvcc_build.load("MOE_CUDA_CUTLASS_LIB", out, build)
    path = os.environ.get("MOE_CUDA_CUTLASS_LIB") or str(out)
    count = getattr(lib, "moe_cutlass_num_variants", None)  # absent: a library from before the bf16 kernels
    if count is None or count() != len(VARIANTS):
        found = f"{count()} kernel variants" if count else "the older FP8-only API"
        raise RuntimeError(f"{path} has {found}, this plugin expects {len(VARIANTS)} variants: rebuild it "
                           f"from {SOURCE.name}")
    ci, cs, vp = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p
    lib.moe_cutlass_last_error.restype = ctypes.c_char_p
    lib.moe_cutlass_workspace_size.argtypes = [ci, ci]
    lib.moe_cutlass_workspace_size.restype = cs
    lib.moe_cutlass_grouped_gemm.argtypes = [ci, vp, vp, vp, vp, vp, vp, vp, vp, cs, vp, ci, ci]
    lib.moe_cutlass_grouped_gemm.restype = ci
    return lib

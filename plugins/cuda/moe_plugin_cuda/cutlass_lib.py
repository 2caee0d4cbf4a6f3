"""The CUTLASS FP8 block-scaled grouped GEMM (``csrc/fp8_blockwise_grouped.cu``): find, build, load.

The library is compiled with nvcc at first use, against the CUTLASS headers of the
``nvidia-cutlass`` wheel (or ``$CUTLASS_DIR``), into a per-user cache keyed by the source, the
headers and nvcc; ``$MOE_CUDA_CUTLASS_LIB`` names a prebuilt library instead. It has a plain C ABI
(no torch headers, so no torch ABI to match) and links the CUDA runtime statically.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).parent / "csrc" / "fp8_blockwise_grouped.cu"
# The kernels the source instantiates, by index: (schedule and tile, cluster, D's dtype). Each compiles as its
# own object, in parallel. GEMM1 runs an fp32 one, GEMM2 a bf16 one; the tuned table picks which, per T.
VARIANTS = (("coop 128x128x128", "1x1", "bf16"), ("coop 128x128x128", "1x1", "fp32"),
            ("ping 64x128x128", "1x1", "bf16"), ("coop 128x128x128", "1x2", "bf16"),
            ("ping 64x128x128", "1x1", "fp32"), ("coop 128x128x128", "2x1", "bf16"),
            ("coop 128x128x128", "2x1", "fp32"), ("ping 64x128x128", "2x1", "fp32"),
            ("ping 64x128x128", "2x1", "bf16"))
DEFAULT_VARIANTS = (1, 0)  # (GEMM1, GEMM2) without a tuned choice: the cooperative 128x128 kernels


def variants_with_output(dtype: str) -> list[int]:
    """The variants writing D in ``dtype`` ("bf16" or "fp32")."""
    return [k for k, v in enumerate(VARIANTS) if v[2] == dtype]


def cutlass_dir() -> Optional[Path]:
    """CUTLASS source root (``include/``, ``tools/util/include/``): ``$CUTLASS_DIR`` or the wheel's copy."""
    env = os.environ.get("CUTLASS_DIR")
    if env:
        return Path(env)
    try:
        root = Path(metadata.distribution("nvidia-cutlass").locate_file("cutlass_library/source"))
    except metadata.PackageNotFoundError:
        return None
    return root if (root / "include" / "cutlass").is_dir() else None


def nvcc() -> Optional[str]:
    """The toolkit's nvcc: torch's own CUDA_HOME lookup (CUDA_HOME/CUDA_PATH, nvcc on PATH, /usr/local/cuda)."""
    from torch.utils.cpp_extension import CUDA_HOME

    path = Path(CUDA_HOME or "/nonexistent") / "bin" / "nvcc"
    return str(path) if path.exists() else shutil.which("nvcc")


def missing() -> Optional[str]:
    """Why the library can be neither loaded nor built here (None: it can)."""
    if os.environ.get("MOE_CUDA_CUTLASS_LIB"):
        return None if Path(os.environ["MOE_CUDA_CUTLASS_LIB"]).exists() else \
            f"MOE_CUDA_CUTLASS_LIB={os.environ['MOE_CUDA_CUTLASS_LIB']} does not exist"
    if cutlass_dir() is None:
        return "no CUTLASS headers (pip install 'moe-plugin-cuda[cutlass]', or set CUTLASS_DIR)"
    if nvcc() is None:
        return "no nvcc (install the CUDA toolkit or set CUDA_HOME): the kernels are compiled at first use"
    return None


def where() -> str:
    """Where the library comes from (for ``moe-core backends``), without building it."""
    if os.environ.get("MOE_CUDA_CUTLASS_LIB"):
        return os.environ["MOE_CUDA_CUTLASS_LIB"]
    return f"compiled at first use from {SOURCE.name} against {cutlass_dir()}"


def _cache_path(cdir: Path, compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update((cdir / "include" / "cutlass" / "version.h").read_bytes())
    h.update(version.encode())
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moe_plugin_cuda"
    return base / f"cutlass-fp8-{h.hexdigest()[:16]}" / "libmoe_cutlass_fp8.so"


def build(out: Path, cdir: Path, compiler: str) -> None:
    """One object per variant plus the API object, compiled in parallel (as many nvcc as there are cores and
    4 GB of free memory: each peaks at ~3.9 GB and takes a minute or more), linked with a static cudart."""
    flags = ["-O3", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
             "-Xcompiler", "-fvisibility=hidden", "-DNDEBUG", f"-I{cdir / 'include'}",
             f"-I{cdir / 'tools/util/include'}"]
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [("api", ["-DMOE_VARIANT_MASK=0"])] + [(f"v{k}", [f"-DMOE_VARIANT_MASK={1 << k}", "-DMOE_NO_API"])
                                                       for k in range(len(VARIANTS))]

        def compile_object(job) -> None:
            name, extra = job
            r = subprocess.run([compiler, *flags, *extra, "-c", str(SOURCE), "-o", f"{tmp}/{name}.o"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if r.returncode:
                raise RuntimeError(f"nvcc failed on {SOURCE.name} ({name}):\n{r.stdout[-4000:]}")

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        workers = max(1, min(len(jobs), os.cpu_count() or 1, free // (4 << 30)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(compile_object, jobs))  # re-raises the first failure
        tmp_out = Path(tmp) / out.name
        root = Path(compiler).resolve().parent.parent  # the toolkit's lib dirs (pip's nvcc is not on ld's path)
        link = [compiler, "-arch=sm_90a", "-shared", "-cudart", "static", "-Xlinker", "--exclude-libs,ALL",
                "-Xlinker", "-Bsymbolic", f"-L{root / 'lib'}", f"-L{root / 'lib64'}", "-o", str(tmp_out),
                *[f"{tmp}/{n}.o" for n, _ in jobs]]
        r = subprocess.run(link, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"linking {out.name} failed:\n{r.stderr[-4000:]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(tmp_out), out)  # the cache only ever holds whole libraries


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded library (built first if needed; a file lock keeps concurrent processes to one build)."""
    path = os.environ.get("MOE_CUDA_CUTLASS_LIB")
    if not path:
        why = missing()
        if why:
            raise RuntimeError(f"the cutlass experts cannot run: {why}")
        cdir, compiler = cutlass_dir(), nvcc()
        out = _cache_path(cdir, compiler)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not out.exists():
                build(out, cdir, compiler)
        path = str(out)
    lib = ctypes.CDLL(path)
    ci, cs, vp = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p
    lib.moe_fp8_blockwise_last_error.restype = ctypes.c_char_p
    lib.moe_fp8_blockwise_workspace_size.argtypes = [ci, ci]
    lib.moe_fp8_blockwise_workspace_size.restype = cs
    lib.moe_fp8_blockwise_grouped_gemm.argtypes = [ci, vp, vp, vp, vp, vp, vp, vp, vp, cs, vp, ci, ci]
    lib.moe_fp8_blockwise_grouped_gemm.restype = ci
    if lib.moe_fp8_blockwise_num_variants() != len(VARIANTS):  # e.g. an old MOE_CUDA_CUTLASS_LIB
        raise RuntimeError(f"{path} has {lib.moe_fp8_blockwise_num_variants()} kernel variants, this plugin expects "
                           f"{len(VARIANTS)}: rebuild it from {SOURCE.name}")
    return lib

"""Shared libraries compiled with nvcc at first use (the CUTLASS and DeepGEMM kernels): build, cache, load.

A library has a plain C ABI (no torch headers, so no torch ABI to match) and links the CUDA runtime
statically. It is built as one object per kernel variant plus an API object, in parallel, into a
per-user cache keyed by the source, the headers' version stamp and nvcc; an environment variable
can name a prebuilt library instead.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence


def nvcc() -> Optional[str]:
    """The toolkit's nvcc: torch's own CUDA_HOME lookup (CUDA_HOME/CUDA_PATH, nvcc on PATH, /usr/local/cuda)."""
    from torch.utils.cpp_extension import CUDA_HOME

    path = Path(CUDA_HOME or "/nonexistent") / "bin" / "nvcc"
    return str(path) if path.exists() else shutil.which("nvcc")


def headers(env_var: str, distribution: str, subdir: str, marker: str) -> Optional[Path]:
    """A header tree: ``$env_var``, else ``subdir`` of the installed ``distribution`` if it holds ``marker``."""
    env = os.environ.get(env_var)
    if env:
        return Path(env)
    try:
        root = Path(metadata.distribution(distribution).locate_file(subdir))
    except metadata.PackageNotFoundError:
        return None
    return root if (root / marker).exists() else None


def missing(prebuilt_env: str, headers: Optional[Path], no_headers: str, compiler: Optional[str]) -> Optional[str]:
    """Why a library can be neither loaded (``$prebuilt_env``) nor built (``headers``, nvcc) here (None: it can)."""
    path = os.environ.get(prebuilt_env)
    if path:
        return None if Path(path).exists() else f"{prebuilt_env}={path} does not exist"
    if headers is None:
        return no_headers
    if compiler is None:
        return "no nvcc (install the CUDA toolkit or set CUDA_HOME): the kernels are compiled at first use"
    return None


def where(prebuilt_env: str, source: Path, headers: Optional[Path]) -> str:
    """Where a library comes from (for ``moe-core backends``), without building it."""
    return os.environ.get(prebuilt_env) or f"compiled at first use from {source.name} against {headers}"


def cache_path(source: Path, stamp: Path, compiler: str, lib_name: str) -> Path:
    """Where the library built from ``source`` against the headers versioned by ``stamp`` is cached."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256(source.read_bytes())
    h.update(stamp.read_bytes())
    h.update(version.encode())
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moe_plugin_cuda"
    return base / f"{Path(lib_name).stem}-{h.hexdigest()[:16]}" / lib_name


def build(out: Path, source: Path, compiler: str, flags: Sequence[str], jobs: Sequence[tuple[str, Sequence[str]]],
          arch: str, mem_per_job: int = 4 << 30) -> None:
    """Compile ``source`` once per job (name, extra flags), as many at a time as there are cores and
    ``mem_per_job`` of free memory (a CUTLASS object peaks at ~3.9 GB), then link the objects."""
    with tempfile.TemporaryDirectory() as tmp:

        def compile_object(job) -> None:
            name, extra = job
            r = subprocess.run([compiler, *flags, *extra, "-c", str(source), "-o", f"{tmp}/{name}.o"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if r.returncode:
                raise RuntimeError(f"nvcc failed on {source.name} ({name}):\n{r.stdout[-4000:]}")

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        workers = max(1, min(len(jobs), os.cpu_count() or 1, free // mem_per_job))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(compile_object, jobs))  # re-raises the first failure
        tmp_out = Path(tmp) / out.name
        root = Path(compiler).resolve().parent.parent  # the toolkit's lib dirs (pip's nvcc is not on ld's path)
        link = [compiler, arch, "-shared", "-cudart", "static", "-Xlinker", "--exclude-libs,ALL",
                "-Xlinker", "-Bsymbolic", f"-L{root / 'lib'}", f"-L{root / 'lib64'}", "-o", str(tmp_out),
                *[f"{tmp}/{n}.o" for n, _ in jobs]]
        r = subprocess.run(link, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"linking {out.name} failed:\n{r.stderr[-4000:]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(tmp_out), out)  # the cache only ever holds whole libraries


def load(prebuilt_env: str, out: Optional[Path], build_fn) -> ctypes.CDLL:
    """``$prebuilt_env`` if set, else ``out`` (built first by ``build_fn(out)``; a file lock keeps
    concurrent processes to one build)."""
    path = os.environ.get(prebuilt_env)
    if not path:
        assert out is not None
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not out.exists():
                build_fn(out)
        path = str(out)
    return ctypes.CDLL(path)

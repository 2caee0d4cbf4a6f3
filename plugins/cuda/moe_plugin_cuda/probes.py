"""Availability probes and plan-time checks of the CUDA backends.

Probes never raise and import vendor libraries only inside the function (never at plugin
import). Order of verdicts: the device (NO_DEVICE / UNSUPPORTED_ARCH) first when the backend is
arch-bound, so an operator on a Hopper box learns that CuteDSL needs Blackwell before being told
to install FlashInfer; then the package (NOT_INSTALLED / LOAD_ERROR / API_MISMATCH).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Optional

from moe_core.plugin_api import Code, Reason, available, from_exception, unavailable

if TYPE_CHECKING:
    from moe_core.plugin_api import BackendSpec, MoEConfig

# low-latency hidden sizes DeepEP V1 instantiates kernels for
DEEPEP_LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
# ranks for which Buffer.get_dispatch_config / get_combine_config have a table entry
DEEPEP_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
CUTEDSL_ARCHS = ((10, 0), (10, 3), (10, 7))


def _cuda_capability() -> tuple[Optional[tuple[int, int]], Optional[Reason]]:
    try:
        import torch

        if getattr(torch.version, "hip", None):
            return None, unavailable(Code.NO_DEVICE, "this PyTorch is a ROCm build", "use moe-plugin-rocm on AMD GPUs")
        if torch.version.cuda is None:
            return None, unavailable(Code.NO_DEVICE, "this PyTorch has no CUDA support",
                                     "install a CUDA build of torch on a machine with an NVIDIA GPU")
        if not torch.cuda.is_available():
            return None, unavailable(Code.NO_DEVICE, "no CUDA device is visible",
                                     "run on a machine with an NVIDIA GPU (check CUDA_VISIBLE_DEVICES)")
        return torch.cuda.get_device_capability(), None
    except Exception as exc:
        return None, from_exception(Code.LOAD_ERROR, "querying the CUDA device failed", exc)


def _import(module: str, package_hint: str) -> tuple[object, Optional[Reason]]:
    try:
        if importlib.util.find_spec(module) is None:
            return None, unavailable(Code.NOT_INSTALLED, f"{module} is not installed", package_hint)
    except Exception as exc:  # a broken parent package
        return None, from_exception(Code.LOAD_ERROR, f"locating {module} failed", exc)
    try:
        return importlib.import_module(module), None
    except Exception as exc:
        return None, from_exception(Code.LOAD_ERROR, f"importing {module} failed", exc)


def probe_triton() -> Reason:
    cap, why = _cuda_capability()
    if why:
        return why
    if cap < (8, 0):
        return unavailable(Code.UNSUPPORTED_ARCH, f"compute capability {cap[0]}.{cap[1]} < 8.0",
                           "the Triton kernels need SM80+ (bf16 tensor cores)")
    triton, why = _import("triton", "pip install triton (a version matching your torch)")
    if why:
        return why
    return available(f"triton {getattr(triton, '__version__', '?')} on SM{cap[0]}{cap[1]}")


def probe_grouped_mm() -> Reason:
    cap, why = _cuda_capability()
    if why:
        return why
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return unavailable(Code.API_MISMATCH, f"torch {torch.__version__} has no torch._grouped_mm",
                           "upgrade to torch >= 2.8")
    if cap[0] not in (9, 10):
        return unavailable(Code.UNSUPPORTED_ARCH,
                           f"compute capability {cap[0]}.{cap[1]}: torch._grouped_mm has its CUTLASS kernel on "
                           "SM90/SM100 only (elsewhere a per-group mm loop that syncs with the host)",
                           "use the triton experts on this GPU")
    return available(f"torch {torch.__version__} on SM{cap[0]}{cap[1]}")


def probe_cutlass() -> Reason:
    cap, why = _cuda_capability()
    if why:
        return why
    if cap != (9, 0):
        return unavailable(Code.UNSUPPORTED_ARCH, f"compute capability {cap[0]}.{cap[1]}: the CUTLASS grouped GEMMs "
                           "are built for SM90a (Hopper wgmma/TMA) only", "use the triton experts on this GPU")
    triton, why = _import("triton", "pip install triton (a version matching your torch)")
    if why:
        return why
    from moe_plugin_cuda.cutlass import lib as cutlass_lib

    missing = cutlass_lib.missing()
    if missing:
        return unavailable(Code.NOT_INSTALLED, missing, "pip install 'moe-plugin-cuda[cutlass]' with the CUDA "
                           "toolkit's nvcc on PATH (the kernels compile at first use, ~1-2 minutes)")
    from moe_plugin_cuda.deepgemm import lib as deepgemm_lib

    deepgemm = deepgemm_lib.missing()
    return available(f"CUTLASS FP8 block-scaled and bf16 grouped GEMMs on SM90 (library: {cutlass_lib.where()}); "
                     "DeepGEMM's SM90 kernels: "
                     + (f"not used ({deepgemm})" if deepgemm else f"library {deepgemm_lib.where()}"))


# what DeepEPDispatcher calls on deep_ep.Buffer (DeepEP v1.2.1; 2.x's legacy Buffer keeps them)
DEEPEP_V1_METHODS = ("get_dispatch_config", "get_combine_config", "get_low_latency_rdma_size_hint", "capture",
                     "get_dispatch_layout", "dispatch", "combine", "clean_low_latency_buffer",
                     "low_latency_dispatch", "low_latency_combine")


def probe_deepep() -> Reason:
    mod, why = _import("deep_ep", "build DeepEP from source (github.com/deepseek-ai/DeepEP, V1 Buffer API, "
                       "e.g. v1.2.1); it is not on PyPI")
    if why:
        return why
    version = getattr(mod, "__version__", None)
    buf = getattr(mod, "Buffer", None)
    if buf is None:
        return unavailable(Code.API_MISMATCH, f"deep_ep {version or ''} has no V1 Buffer class".replace("  ", " "),
                           "install a DeepEP version that still exports deep_ep.Buffer (V1 API: 1.x, or 2.x's "
                           "legacy Buffer)")
    missing = [m for m in DEEPEP_V1_METHODS if not hasattr(buf, m)]
    if missing:
        return unavailable(Code.API_MISMATCH, f"deep_ep.Buffer lacks the V1 method(s) {', '.join(missing)}",
                           "install DeepEP v1.2.1 or a 2.x whose legacy Buffer keeps the V1 API")
    cap, why = _cuda_capability()
    if why:
        return why
    # 2.x exports ElasticBuffer beside the legacy V1 Buffer, which is what moe-core drives
    api = "the legacy V1 deep_ep.Buffer API (not ElasticBuffer)" if hasattr(mod, "ElasticBuffer") \
        else "the V1 deep_ep.Buffer API"
    return available(f"DeepEP {version or '1.x (no __version__)'} on SM{cap[0]}{cap[1]}, through {api}")


def probe_cutedsl() -> Reason:
    cap, why = _cuda_capability()
    if why:
        return why
    if tuple(cap) not in CUTEDSL_ARCHS:
        return unavailable(Code.UNSUPPORTED_ARCH,
                           f"FlashInfer's CuteDSL masked grouped GEMM runs on SM100/SM103/SM107 only; this GPU is "
                           f"SM{cap[0]}{cap[1]}",
                           "on Hopper use the triton experts (FP8 block) with the deepep or torch_a2a dispatcher")
    fi, why = _import("flashinfer", "pip install 'moe-plugin-cuda[flashinfer]' (flashinfer-python, nvidia-cutlass-dsl)")
    if why:
        return why
    missing = [n for n in ("grouped_gemm_nt_masked", "scaled_fp4_grouped_quantize",
                           "silu_and_mul_scaled_nvfp4_experts_quantize") if not _has_flashinfer_symbol(fi, n)]
    if missing:
        return unavailable(Code.API_MISMATCH, f"flashinfer {getattr(fi, '__version__', '?')} lacks "
                           + ", ".join(missing), "install flashinfer-python 0.7.2.post1")
    return available(f"flashinfer {getattr(fi, '__version__', '?')} on SM{cap[0]}{cap[1]}")


def _has_flashinfer_symbol(fi: object, name: str) -> bool:
    if hasattr(fi, name):
        return True
    try:
        return hasattr(importlib.import_module("flashinfer.gemm"), name)
    except Exception:
        return False


# --------------------------------------------------------------------------- plan-time checks


def check_triton(config: "MoEConfig", spec: "BackendSpec") -> list[Reason]:
    out = []
    if config.apply_router_weight_on_input:
        out.append(unavailable(Code.UNSUPPORTED_SHAPE, "triton experts weight the expert outputs; "
                               "apply_router_weight_on_input is not implemented", "use the reference experts"))
    return out


def check_cutlass(config: "MoEConfig", spec: "BackendSpec") -> list[Reason]:
    import torch

    out = check_triton(config, spec)  # its activation and re-quantization kernels are Triton's
    fp8 = str(config.quant) == "fp8_block"
    align = 128 if fp8 else 8
    for name in ("hidden_size", "intermediate_size"):
        if getattr(config, name) % align:
            why = ("whole 128x128 scale blocks in the FP8 grouped GEMMs" if fp8
                   else "16-byte rows for the bf16 grouped GEMM's TMA loads")
            out.append(unavailable(Code.UNSUPPORTED_SHAPE, f"{name}={getattr(config, name)} is not a multiple of "
                                   f"{align} ({why})", "use the triton experts"))
    if not fp8 and config.params_dtype is not torch.bfloat16:
        out.append(unavailable(Code.UNSUPPORTED_QUANT, f"unquantized cutlass experts run bf16 grouped GEMMs "
                               f"(params_dtype={config.params_dtype})", "use bf16 params or the triton experts"))
    return out


def check_grouped_mm(config: "MoEConfig", spec: "BackendSpec") -> list[Reason]:
    import torch

    out = []
    if config.params_dtype is not torch.bfloat16:
        out.append(unavailable(Code.UNSUPPORTED_QUANT, f"torch._grouped_mm's CUTLASS path is bf16 only "
                               f"(params_dtype={config.params_dtype})", "use bf16 params or the triton experts"))
    align = 16 if str(config.quant) == "fp8_per_token" else 8
    for name in ("hidden_size", "intermediate_size"):
        if getattr(config, name) % align:
            out.append(unavailable(Code.UNSUPPORTED_SHAPE, f"{name}={getattr(config, name)} is not a multiple of "
                                   f"{align} (16-byte row alignment of the grouped GEMM)", "use the triton experts"))
    if config.apply_router_weight_on_input:
        out.append(unavailable(Code.UNSUPPORTED_SHAPE, "apply_router_weight_on_input is not implemented",
                               "use the reference experts"))
    return out


def deepep_low_latency_forced(config: "MoEConfig") -> bool:
    """The planner will pick EP_MASKED (low-latency mode) whatever the experts accept."""
    return config.dispatch_format == "ep_masked" or config.cuda_graph  # normal mode is not graph-safe


def deepep_num_max(config: "MoEConfig") -> int:
    """``num_max_dispatch_tokens_per_rank`` for low-latency mode: ``max_tokens_per_rank`` rounded up so
    that ``ep_size * num_max % 4 == 0`` (DeepEP asserts it); the slab only gets a few rows larger."""
    n = config.max_tokens_per_rank or 0
    while (config.ep_size * n) % 4:
        n += 1
    return n


def deepep_problems(config: "MoEConfig", low_latency: bool, wire: Optional[str]) -> list[Reason]:
    """Every reason DeepEP V1 cannot serve ``config`` in the given mode and wire dtype (``None``: not
    decided yet). Constraints from vendor-apis.md section 1 (DeepEP v1.2.1)."""
    out = []
    R, H = config.ep_size, config.hidden_size
    opts = config.options("deepep")
    if R > 1 and R not in DEEPEP_RANKS:
        out.append(unavailable(Code.UNSUPPORTED_PARALLEL, f"DeepEP has no dispatch/combine config for {R} ranks",
                               "EP sizes: " + ", ".join(map(str, DEEPEP_RANKS))))
    if (H * 2) % 16:
        out.append(unavailable(Code.UNSUPPORTED_SHAPE, f"hidden_size={H}: DeepEP needs rows of a multiple of 16 bytes"))
    if wire == "nvfp4":
        out.append(unavailable(Code.UNSUPPORTED_QUANT, "DeepEP V1 has no NVFP4 wire (low_latency_dispatch quantizes "
                               "to FP8 only; normal dispatch takes bf16 or FP8)",
                               "use dispatch_dtype fp8 or bf16 (NVFP4 experts quantize the BF16 slab themselves)"))
    if wire == "fp8" and not low_latency and H % 128:
        out.append(unavailable(Code.UNSUPPORTED_SHAPE, f"FP8 normal dispatch takes scales [T, H/128]: hidden_size={H} "
                               "is not a multiple of 128", "use dispatch_dtype bf16"))
    if not low_latency:
        return out
    if H not in DEEPEP_LL_HIDDEN:
        out.append(unavailable(Code.UNSUPPORTED_SHAPE, f"hidden_size={H} has no DeepEP low-latency kernel",
                               "supported: " + ", ".join(map(str, DEEPEP_LL_HIDDEN))))
    if wire == "fp8" and H % 512:
        out.append(unavailable(Code.UNSUPPORTED_SHAPE, f"FP8 low-latency dispatch needs hidden_size % 512 == 0 "
                               f"(got {H})"))
    if config.max_tokens_per_rank is None:
        out.append(unavailable(Code.UNSUPPORTED_SHAPE, "low-latency mode needs max_tokens_per_rank",
                               "set max_tokens_per_rank (<= 511 at NVSHMEM_QP_DEPTH=1024)"))
    else:
        num_max = deepep_num_max(config)
        qp_depth = int(opts.get("qp_depth", 1024))
        if qp_depth < 2 * (num_max + 1):
            out.append(unavailable(Code.UNSUPPORTED_SHAPE, f"max_tokens_per_rank={config.max_tokens_per_rank} "
                                   f"(num_max_dispatch_tokens_per_rank {num_max}) needs NVSHMEM_QP_DEPTH >= "
                                   f"{2 * (num_max + 1)} (have {qp_depth})",
                                   "lower max_tokens_per_rank or raise backend_options deepep.qp_depth"))
    qps = opts.get("num_qps_per_rank")
    if qps is not None and int(qps) != config.num_local_experts:
        out.append(unavailable(Code.UNSUPPORTED_PARALLEL, f"num_qps_per_rank={qps} must equal the local "
                               f"expert count {config.num_local_experts} in low-latency mode",
                               "leave num_qps_per_rank unset (the dispatcher uses the local expert count)"))
    return out


def check_deepep(config: "MoEConfig", spec: "BackendSpec") -> list[Reason]:
    """What is known before the pair is chosen: the mode when the config forces low latency, the wire
    dtype when the user chose it. The rest is checked by the plugin's dtype validation wrapper, which
    sees the chosen format and dtype (``plugin.CudaPlugin.deepep_validation``)."""
    wire = None if config.dispatch_dtype == "auto" else str(config.dispatch_dtype)
    return deepep_problems(config, deepep_low_latency_forced(config), wire)


def check_cutedsl(config: "MoEConfig", spec: "BackendSpec") -> list[Reason]:
    out = []
    H, inter = config.hidden_size, config.intermediate_size
    if H % 128 or inter % 128:
        out.append(unavailable(Code.UNSUPPORTED_SHAPE, f"hidden_size={H} and intermediate_size={inter} must be "
                               "multiples of 128 (NVFP4 swizzled scale tiles)"))
    if config.max_tokens_per_rank is None:
        out.append(unavailable(Code.UNSUPPORTED_SHAPE, "cutedsl runs on masked slabs: set max_tokens_per_rank"))
    import torch

    if config.params_dtype not in (torch.bfloat16, torch.float16):
        out.append(unavailable(Code.UNSUPPORTED_SHAPE, f"cutedsl's NVFP4 quantization kernels take bf16/fp16 "
                               f"activations (params_dtype={config.params_dtype})", "use bf16 params"))
    return out

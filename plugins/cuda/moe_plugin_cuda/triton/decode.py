"""The decode path of the triton experts: two GEMV kernels over the touched experts (docs/decisions.md, "A decode
path: two GEMV launches, no alignment").

At a few tokens every expert sees one or two rows, so the pipeline's alignment, its M >= 16 tensor-core tiles and
its per-slot output are overhead around what the step costs: streaming the touched experts' weights once. Here:

1. ``_decode_gate_up_kernel``, grid (T*K slots, I-blocks): each program reads its slot's expert id straight from
   ``topk_ids`` (no sort; ids outside [0, E) return), dots the token against its block of gate and up rows
   (contiguous rows of H) and writes ``h = act(gate) * up`` in fp32 to a [T*K, I] scratch.
2. ``_decode_down_kernel``, grid (T, H-blocks): each program sums over the token's K slots, in registers, the
   top-k-weighted dot products of h with its block of w2 rows (contiguous rows of I), times the routed scaling
   factor, and writes the output: deterministic, no atomics, no reduction launch.

FP8 block: both kernels compute with the scheme's codes, as the pipeline does: the token quantized per 128-column
group (or its codes and scales as dispatched), h quantized per 128-column group, products of codes summed per
group in fp32 and scaled by the activation and weight block scales (``kernels._decode_gate_up_kernel``).

Form 2 (a config part's ``"FORM": 2``; docs/decisions.md, "FP8 decode kernels, form 2"): the same math with the
threads over a step's columns and the rows in registers, so the FP8 quantization of a step is paid once per value;
gate/up programs own ``SLOTS`` slots x ``BLOCK_I`` rows; the down kernel may ``SPLIT`` over slots (fp32 partials
reduced in slot order by the last program of each token and H-block: deterministic). Form 2's ``num_stages`` > 1
runs Triton's software pipeline over both loops (cp.async through shared memory), and ``"PDL": 2`` releases the down
kernel as the gate/up programs start (docs/decisions.md, "Decode kernels: pipelined loads"). ``"L2PF"`` (form-2
gate/up): each gate/up program first prefetches its share of its experts' down weights into L2 with one Hopper bulk
prefetch, so the down kernel reads them from L2 while HBM streams gate/up (docs/decisions.md, "Decode: the down
weights prefetched into L2 by the gate/up programs").
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from moe_plugin_cuda.triton import kernels
from moe_plugin_cuda.triton.launch import launch
from moe_plugin_cuda.workspace import Layouts, layout

ACT_IDS = {"silu": 0, "gelu": 1}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_experts(hidden: torch.Tensor, a_scale: Optional[torch.Tensor], w13: torch.Tensor, w2: torch.Tensor,
                   w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor], topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, *, fp8_block: bool, activation: str, routed_scaling_factor: float,
                   out_dtype: torch.dtype, cfg: dict, w13_interleaved: bool, out: Optional[torch.Tensor] = None,
                   layouts: Optional[Layouts] = None) -> tuple[torch.Tensor, Optional[tuple[int, int]]]:
    """``triton.ops.fused_experts``'s math (same arguments) in the two decode launches: (the output [T, H], the
    scratch's byte range or None). ``cfg``: ``{"decode": {BLOCK_I, GROUPS, num_warps, num_stages}, "down":
    {BLOCK_H, GROUPS, FLAT, num_warps, num_stages}, "PDL": 0, 1 or 2, "L2PF": fraction, "L2PF_KEEP": 0 or 1}``
    (GROUPS: 128-column groups a loop step; L2PF, form-2 gate/up: ``prefetch_args``)
    (``tuning_configs.decode_config``; PDL: the down kernel launched with programmatic dependent launch, released by
    the gate/up programs past their loop (1) or, form-2 gate/up, as they start (2); form 1 treats 2 as 1)."""
    T, H = hidden.shape
    E, n1, _ = w13.shape
    inter = n1 // 2
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty((T, H), dtype=out_dtype, device=hidden.device)
    if T == 0:
        return out, None
    for name, t in (("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the decode kernels read contiguous weight rows, got strides {t.stride()}")
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    c1, c2 = cfg["decode"], cfg["down"]
    split = bool(c2.get("SPLIT", 0))
    if split and c1.get("FORM", 1) != 2:
        raise ValueError(f"decode config: down.SPLIT needs the form-2 gate/up kernel (it zeroes the split's "
                         f"counters), got decode {c1}")
    n_hb = _cdiv(H, c2["BLOCK_H"])
    parts = [(torch.float32, (T * top_k, inter))]
    if split:  # the slots' partial outputs and each token's H-block counters
        parts += [(torch.float32, (T * top_k, H)), (torch.int32, (T, n_hb))]
    lay = layout(layouts, ("decode", T, top_k, inter, H, n_hb, split, hidden.device), lambda: parts)
    h, *split_bufs = lay.carve(hidden.device)
    part, cnt = split_bufs if split else (None, None)
    pdl = int(cfg.get("PDL", 0))
    l2pf = prefetch_args(w2, w2_scale if fp8_block else None, float(cfg.get("L2PF", 0)), bool(cfg.get("L2PF_KEEP", 0)),
                         _cdiv(inter, c1["BLOCK_I"])) if c1.get("FORM", 1) == 2 else None
    gate_up(hidden, a_scale, w13, w13_scale, topk_ids, h, fp8_block=fp8_block, activation=activation,
            w13_interleaved=w13_interleaved, cfg=c1, pdl=pdl, cnt=cnt, l2pf=l2pf)
    down(h, w2, w2_scale, topk_ids, topk_weights, out, fp8_block=fp8_block,
         routed_scaling_factor=routed_scaling_factor, cfg=c2, pdl=bool(pdl), part=part, cnt=cnt)
    base = h.untyped_storage().data_ptr()
    return out, (base, base + lay.nbytes)


_bulk_prefetch: dict[int, bool] = {}  # per device index: cp.async.bulk.prefetch exists (sm_90 and later)


def prefetch_args(w2: torch.Tensor, w2_scale: Optional[torch.Tensor], fraction: float, keep: bool,
                  n_programs: int) -> Optional[tuple]:
    """The form-2 gate/up kernel's L2 prefetch of the down weights (a decode config's ``"L2PF"``: the fraction of
    each touched expert's w2 bytes, from its start; ``"L2PF_KEEP"``: with an evict_last policy): the kernel's
    (pf_ptr, pf_stride_e, pf_chunk, pf_limit, pfs_ptr, pfs_stride_e, pfs_bytes) and its L2PF (1, or 2 kept), the
    ``n_programs`` I-blocks of a slot sharing the bytes (strides and sizes in bytes) in 16-byte-multiple chunks;
    None (no prefetch) for fraction 0, in Triton's interpreter, before sm_90, or where the bulk
    prefetch's 16-byte alignment does not hold or an expert's rows are padded. A prefetch only moves bytes into L2:
    the numbers are unchanged."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"decode config: L2PF must be a fraction of the down weights in [0, 1], got {fraction}")
    if fraction == 0 or _interpreting():
        return None
    elt = w2.element_size()
    stride_e = w2.stride(0) * elt
    if not _dense_rows(w2) or w2.data_ptr() % 16 or stride_e % 16 or not _has_bulk_prefetch(w2.device):
        return None
    span = w2.shape[1] * w2.shape[2] * elt  # (an expert's rows, contiguous)
    limit = int(span * fraction) // 16 * 16
    chunk = _cdiv(_cdiv(limit, n_programs), 16) * 16
    s_stride = s_bytes = 0
    if (w2_scale is not None and _dense_rows(w2_scale) and w2_scale.data_ptr() % 16 == 0
            and (w2_scale.stride(0) * 4) % 16 == 0):
        s_stride = w2_scale.stride(0) * 4
        s_bytes = w2_scale.shape[1] * w2_scale.shape[2] * 4 // 16 * 16
    return w2, stride_e, chunk, limit, w2_scale if s_bytes else w2, s_stride, s_bytes, 2 if keep else 1


def _dense_rows(w: torch.Tensor) -> bool:
    """An expert's rows back to back ([E, rows, cols], cols contiguous, no row padding): a prefetch of whole rows
    stays inside the tensor."""
    return w.dim() == 3 and w.stride(2) == 1 and w.stride(1) == w.shape[2]


def _has_bulk_prefetch(device: torch.device) -> bool:
    dev = device.index if device.index is not None else torch.cuda.current_device()
    if dev not in _bulk_prefetch:
        _bulk_prefetch[dev] = torch.cuda.get_device_capability(dev)[0] >= 9
    return _bulk_prefetch[dev]


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _w_evict(part: dict) -> str:
    """A form-2 config part's ``"STREAM"``: its weight loads with an L2 evict_first policy (read once), so they do
    not push prefetched lines out of L2; else the default policy."""
    return "evict_first" if part.get("STREAM") else ""


def _vec(t: torch.Tensor) -> int:
    """Elements of ``t`` in one 16-byte load (form 2's innermost tile axis)."""
    return 16 // t.element_size()


def gate_up(hidden, a_scale, w13, w13_scale, topk_ids, h, *, fp8_block: bool, activation: str, w13_interleaved: bool,
            cfg: dict, pdl: int = 0, cnt: Optional[torch.Tensor] = None, l2pf: Optional[tuple] = None) -> None:
    """``kernels._decode_gate_up_kernel`` (``cfg["FORM"]`` 1, the default) or ``_decode_gate_up_v2_kernel`` (2) into
    ``h`` [T*K, I] fp32 (``cfg``: a decode config's "decode" part; ``pdl``: the down kernel follows with programmatic
    dependent launch, released past the loop (1) or, form 2, at the start (2); ``cnt``: [T, H-blocks] int32 counters of the split down kernel, zeroed here, form 2; form 2's
    ``SLOTS``: slots a program, default 1; ``l2pf``: form 2, ``prefetch_args``' down weights to prefetch into L2)."""
    T, H = hidden.shape
    E, n1, _ = w13.shape
    inter, top_k = n1 // 2, topk_ids.shape[1]
    quant_x = fp8_block and a_scale is None  # (else the dispatched codes and their group scales)
    xs = a_scale if a_scale is not None else hidden  # (unread pointers: any tensor of the call)
    s13 = w13_scale if fp8_block else w13
    if cfg.get("FORM", 1) == 2:
        zero = cnt is not None
        cnt_t = cnt if zero else h  # (unread pointer)
        slots = cfg.get("SLOTS", 1)
        pf = l2pf or (h, 0, 0, 0, h, 0, 0, 0)  # (no prefetch: unread pointers, L2PF 0)
        if top_k % slots or (slots * cfg["BLOCK_I"]) & (slots * cfg["BLOCK_I"] - 1):
            raise ValueError(f"decode gate/up: SLOTS must divide top_k {top_k} and SLOTS x BLOCK_I be a power of "
                             f"two, got SLOTS {slots}, BLOCK_I {cfg['BLOCK_I']}")
        launch(kernels._decode_gate_up_v2_kernel, (T * top_k // slots, _cdiv(inter, cfg["BLOCK_I"])), hidden, xs,
               w13, s13, topk_ids, h, cnt_t, H, inter, E, cnt.shape[1] if zero else 0, hidden.stride(0), xs.stride(0),
               xs.stride(1), topk_ids.stride(0), topk_ids.stride(1), w13.stride(0), w13.stride(1), s13.stride(0),
               s13.stride(1), s13.stride(2), h.stride(0), *pf[:7], TOP_K=top_k, ACT=ACT_IDS[activation], FP8=fp8_block,
               QUANT_X=quant_x, INTERLEAVED=w13_interleaved, SLOTS=slots, BLOCK_I=cfg["BLOCK_I"],
               GROUPS=cfg["GROUPS"], VEC=_vec(w13), EVEN_K=H % (128 * cfg["GROUPS"]) == 0, ZERO_CNT=zero, PDL=pdl,
               STAGES=cfg["num_stages"], L2PF=pf[7], W_EVICT=_w_evict(cfg), num_warps=cfg["num_warps"],
               num_stages=cfg["num_stages"])
        return
    if l2pf is not None:
        raise ValueError("decode gate/up: the down weights' L2 prefetch (L2PF) needs the form-2 kernel (cfg FORM 2)")
    if cnt is not None:
        raise ValueError("decode gate/up: counters to zero need the form-2 kernel (cfg FORM 2)")
    fold = fp8_block and 128 % cfg["BLOCK_I"] == 0 and inter % cfg["BLOCK_I"] == 0
    launch(kernels._decode_gate_up_kernel, (T * top_k, _cdiv(inter, cfg["BLOCK_I"])), hidden, xs, w13, s13, topk_ids,
           h, H, inter, E, hidden.stride(0), xs.stride(0), xs.stride(1), topk_ids.stride(0), topk_ids.stride(1),
           w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), s13.stride(2), h.stride(0),
           TOP_K=top_k, ACT=ACT_IDS[activation], FP8=fp8_block, QUANT_X=quant_x, INTERLEAVED=w13_interleaved,
           BLOCK_I=cfg["BLOCK_I"], GROUPS=cfg["GROUPS"], EVEN_K=H % (128 * cfg["GROUPS"]) == 0,
           FOLD=fold, PDL=bool(pdl),
           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def down(h, w2, w2_scale, topk_ids, topk_weights, out, *, fp8_block: bool, routed_scaling_factor: float,
         cfg: dict, pdl: bool = False, part: Optional[torch.Tensor] = None,
         cnt: Optional[torch.Tensor] = None) -> None:
    """``kernels._decode_down_kernel`` (``cfg["FORM"]`` 1, the default) or ``_decode_down_v2_kernel`` (2) from ``h``
    into ``out`` [T, H] (``cfg``: a decode config's "down" part; ``pdl``: launched with programmatic dependent launch
    behind ``gate_up``, Hopper and later; ``cfg["SPLIT"]``: one program per slot and H-block, ``part`` [T*K, H] fp32
    and ``cnt`` [T, H-blocks] int32 zeroed by ``gate_up``; form 2's ``num_stages`` pipelines the loop)."""
    T, H = out.shape
    E, _, inter = w2.shape
    top_k = topk_ids.shape[1]
    s2 = w2_scale if fp8_block else w2
    if fp8_block and 128 % cfg["BLOCK_H"]:
        raise ValueError(f"FP8 decode: down.BLOCK_H must divide 128 (one weight scale row a program), got "
                         f"{cfg['BLOCK_H']}")
    if cfg.get("FORM", 1) == 2:
        split = bool(cfg.get("SPLIT", 0))
        if split and (part is None or cnt is None):
            raise ValueError("decode down: SPLIT needs the partials (part) and the zeroed counters (cnt)")
        part_t, cnt_t = (part, cnt) if split else (h, h)  # (unread pointers without SPLIT)
        launch(kernels._decode_down_v2_kernel, (T * (top_k if split else 1), _cdiv(H, cfg["BLOCK_H"])), h, w2, s2,
               topk_ids, topk_weights, out, part_t, cnt_t, H, inter, E, float(routed_scaling_factor),
               cnt.shape[1] if split else 0, h.stride(0), topk_ids.stride(0), topk_ids.stride(1),
               topk_weights.stride(0), topk_weights.stride(1), w2.stride(0), w2.stride(1), s2.stride(0),
               s2.stride(1), s2.stride(2), out.stride(0), part_t.stride(0), TOP_K=top_k, FP8=fp8_block,
               BLOCK_H=cfg["BLOCK_H"], GROUPS=cfg["GROUPS"], VEC=_vec(w2), SPLIT=split, PDL=pdl,
               STAGES=cfg["num_stages"], W_EVICT=_w_evict(cfg), num_warps=cfg["num_warps"],
               num_stages=cfg["num_stages"],
               **({"launch_pdl": True} if pdl else {}))
        return
    launch(kernels._decode_down_kernel, (T, _cdiv(H, cfg["BLOCK_H"])), h, w2, s2, topk_ids, topk_weights, out, H,
           inter, E, float(routed_scaling_factor), h.stride(0), topk_ids.stride(0), topk_ids.stride(1),
           topk_weights.stride(0), topk_weights.stride(1), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
           s2.stride(2), out.stride(0), TOP_K=top_k, FP8=fp8_block, BLOCK_H=cfg["BLOCK_H"], GROUPS=cfg["GROUPS"],
           FLAT=bool(cfg.get("FLAT", 1)), PDL=pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
           **({"launch_pdl": True} if pdl else {}))

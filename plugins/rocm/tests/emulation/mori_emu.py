"""Pure-PyTorch emulation of MoRI's ``EpDispatchCombineOp`` (TEST SUPPORT ONLY).

Follows ``shared/reference/vendor-apis.md`` section 4 (API) and section 8 (recipe), and MoRI's
``python/mori/ops/dispatch_combine.py``. Data really moves between processes: every rank
all-gathers the padded send buffers over the default ``torch.distributed`` group (gloo on
CPU) and keeps what is addressed to it. Faithful points a backend can trip on:

- ``dispatch`` sends each token **once per unique destination PE** (``id // experts_per_rank``),
  with its full **global** int32 ids and weights; receive order across source PEs is not
  sorted; outputs are views of persistent buffers of ``W * max_num_inp_token_per_rank`` rows of
  which only the first ``total_recv`` (int32 ``[1]`` on the device) are valid: the rest is NaN
  on first use and **stale rows of the previous call** after that;
- ``combine(input, weights, indices)`` reads only the first ``total_recv`` rows of ``input`` and
  returns, per own token, the **unweighted** sum over its unique destination PEs (weights too,
  so they come back multiplied by the number of PEs); ``quant_type="fp8_direct_cast"`` casts the
  payload to the architecture's FP8 (no scale) and back once;
- a new ``dispatch`` needs ``reset()`` (or ``combine(..., call_reset=True)``) after a combine;
- the op needs ``mori.shmem`` to be initialized first.
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

TOPK_IDX_DTYPE = torch.int32
ARCH_FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
_INPUT_DTYPES = (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e4m3fnuz)


class EpDispatchCombineKernelType(enum.Enum):
    IntraNode = 0
    InterNode = 1
    InterNodeV1 = 2
    InterNodeV1LL = 3
    AsyncLL = 4
    IntraNodeLL = 5


@dataclass
class EpDispatchCombineConfig:
    data_type: torch.dtype
    rank: int
    world_size: int
    hidden_dim: int
    scale_dim: int
    scale_type_size: int
    max_token_type_size: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    warp_num_per_block: int = 8
    block_num: int = 80
    use_external_inp_buf: bool = True
    kernel_type: EpDispatchCombineKernelType = EpDispatchCombineKernelType.IntraNode
    gpu_per_node: int = 8
    rdma_block_num: int = 0
    num_qp_per_pe: int = 1
    quant_type: str = "none"

    @property
    def max_num_tokens_to_recv(self) -> int:
        return self.world_size * self.max_num_inp_token_per_rank


class _Shmem:
    """``mori.shmem``: records which process group was registered."""

    def __init__(self) -> None:
        self.group_name: Optional[str] = None
        self.module = types.ModuleType("mori.shmem")
        self.module.shmem_torch_process_group_init = self.init
        self.module.shmem_finalize = self.finalize

    def init(self, group_name: str) -> None:
        self.group_name = group_name

    def finalize(self) -> None:
        self.group_name = None


def _garbage(shape, dtype, device) -> torch.Tensor:
    if dtype == torch.int32:
        return torch.randint(-(2**20), 2**20, shape, dtype=dtype, device=device)
    if dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        return torch.full(shape, 0x7F if dtype == torch.float8_e4m3fn else 0x80, dtype=torch.uint8,
                          device=device).view(dtype)  # NaN bit patterns
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _all_gather_bytes(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    """All-gather any-dtype tensor of the same shape on every rank (as bytes: gloo lacks fp8)."""
    if world == 1:
        return [t]
    raw = t.contiguous().view(torch.uint8) if t.numel() else torch.zeros(t.shape[:-1] + (0,), dtype=torch.uint8)
    bufs = [torch.empty_like(raw) for _ in range(world)]
    dist.all_gather(bufs, raw)
    return [b.view(t.dtype) if t.numel() else torch.empty(t.shape, dtype=t.dtype) for b in bufs]


class EpDispatchCombineOp:
    def __init__(self, config: EpDispatchCombineConfig, *, _shmem: _Shmem, _arch: str) -> None:
        if _shmem.group_name is None:
            raise RuntimeError("mori shmem is not initialized: call mori.shmem.shmem_torch_process_group_init first")
        self.config = config
        self._arch = _arch
        if config.world_size > 1:
            if not dist.is_initialized() or dist.get_world_size() != config.world_size \
                    or dist.get_rank() != config.rank:
                raise RuntimeError(f"mori emulation: config rank {config.rank}/{config.world_size} does not match "
                                   "the default process group")
        if config.quant_type not in ("none", "fp8_direct_cast"):
            raise ValueError(f"invalid quant_type '{config.quant_type}'")
        self._bufs: dict[str, torch.Tensor] = {}
        self._state = "idle"  # idle -> dispatched -> combined -> (reset) idle
        self._recv_src: Optional[torch.Tensor] = None  # [total_recv, 2] (src_rank, src_tok)
        self._total_recv = 0
        self.calls = {"dispatch": 0, "combine": 0, "reset": 0}

    def _buf(self, name: str, shape, dtype, device) -> torch.Tensor:
        b = self._bufs.get(name)
        if b is None or b.shape != torch.Size(shape) or b.dtype != dtype:
            b = _garbage(shape, dtype, device)  # persistent: later calls leave stale rows
            self._bufs[name] = b
        return b

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, input, weights, scales, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1):
        cfg = self.config
        if self._state != "idle":
            raise RuntimeError("mori: dispatch called again without reset() after the previous combine")
        T, H = input.shape
        K = cfg.num_experts_per_token
        if input.dtype not in _INPUT_DTYPES:
            raise TypeError(f"mori dispatch: unsupported input dtype {input.dtype}")
        if input.element_size() > cfg.max_token_type_size:
            raise ValueError(f"input element size {input.element_size()} > max_token_type_size")
        if H != cfg.hidden_dim or T > cfg.max_num_inp_token_per_rank:
            raise ValueError(f"mori dispatch: input {tuple(input.shape)} exceeds hidden_dim={cfg.hidden_dim} / "
                             f"max_num_inp_token_per_rank={cfg.max_num_inp_token_per_rank}")
        if indices.dtype != TOPK_IDX_DTYPE or tuple(indices.shape) != (T, K):
            raise TypeError(f"mori dispatch: indices must be int32 [{T}, {K}], got {indices.dtype} {tuple(indices.shape)}")
        if weights is None or weights.dtype != torch.float32 or tuple(weights.shape) != (T, K):
            raise TypeError("mori dispatch: weights must be float32 [T, K]")
        n_exp = cfg.num_experts_per_rank * cfg.world_size
        if T and (int(indices.min()) < 0 or int(indices.max()) >= n_exp):
            raise ValueError(f"mori dispatch: expert ids outside [0, {n_exp})")
        has_scales = scales is not None and cfg.scale_dim > 0
        if has_scales and (tuple(scales.shape) != (T, cfg.scale_dim) or scales.element_size() != cfg.scale_type_size):
            raise ValueError(f"mori dispatch: scales must be [{T}, {cfg.scale_dim}] of {cfg.scale_type_size}-byte type")

        dev = input.device
        P = cfg.max_num_inp_token_per_rank
        W = cfg.world_size

        def padded(t, width, dtype):
            out = torch.zeros(P, width, dtype=dtype, device=dev)
            if T:
                out[:T] = t
            return out

        S = cfg.scale_dim if has_scales else 1
        sdt = scales.dtype if has_scales else torch.float32
        send = [padded(input, H, input.dtype), padded(weights, K, torch.float32),
                padded(scales if has_scales else torch.zeros(T, 1), S, sdt), padded(indices, K, torch.int32)]
        count = torch.tensor([T], dtype=torch.int64)
        counts = [int(c) for c in _all_gather_bytes(count, W)]
        gathered = [_all_gather_bytes(t, W) for t in send]

        rows_x, rows_w, rows_s, rows_i, src = [], [], [], [], []
        lo, hi = cfg.rank * cfg.num_experts_per_rank, (cfg.rank + 1) * cfg.num_experts_per_rank
        # receive order is not sorted by source: start after our own rank
        for r in [(cfg.rank + 1 + j) % W for j in range(W)]:
            ids = gathered[3][r][: counts[r]].long()
            to_me = ((ids >= lo) & (ids < hi)).any(dim=1).nonzero().flatten()  # once per token
            for name, acc in enumerate((rows_x, rows_w, rows_s, rows_i)):
                acc.append(gathered[name][r][to_me])
            src.append(torch.stack([torch.full_like(to_me, r), to_me], dim=1))

        total = sum(x.shape[0] for x in rows_x)
        max_recv = cfg.max_num_tokens_to_recv
        out = self._buf("x", (max_recv, H), input.dtype, dev)
        out_w = self._buf("w", (max_recv, K), torch.float32, dev)
        out_i = self._buf("i", (max_recv, K), TOPK_IDX_DTYPE, dev)
        out[:total] = torch.cat(rows_x)
        out_w[:total] = torch.cat(rows_w)
        out_i[:total] = torch.cat(rows_i)
        out_s = None
        if has_scales:
            out_s = self._buf("s", (max_recv, cfg.scale_dim), sdt, dev)
            out_s[:total] = torch.cat(rows_s)
        total_recv = self._buf("total", (1,), TOPK_IDX_DTYPE, dev)
        total_recv.fill_(total)
        self._recv_src = torch.cat(src)
        self._total_recv = total
        self._state = "dispatched"
        self.calls["dispatch"] += 1
        return out, out_w, out_s, out_i, total_recv

    # ------------------------------------------------------------------ combine

    def combine(self, input, weights, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1,
                use_external_inp_buf=-1, call_reset=False):
        cfg = self.config
        if self._state != "dispatched":
            raise RuntimeError(f"mori: combine without a preceding dispatch (state {self._state})")
        n = self._total_recv
        if input.dim() != 2 or input.shape[0] < n or input.shape[1] != cfg.hidden_dim:
            raise ValueError(f"mori combine: input must be [>= total_recv={n}, {cfg.hidden_dim}], "
                             f"got {tuple(input.shape)}")
        if input.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"mori combine: unsupported input dtype {input.dtype}")
        W, K, P = cfg.world_size, cfg.num_experts_per_token, cfg.max_num_inp_token_per_rank
        dev = input.device
        payload = input[:n]
        if cfg.quant_type == "fp8_direct_cast" and input.dtype == torch.bfloat16:
            fp8 = ARCH_FP8[self._arch]
            fmax = torch.finfo(fp8).max
            payload = payload.float().clamp(-fmax, fmax).to(fp8).to(input.dtype)
        max_recv = cfg.max_num_tokens_to_recv
        send_x = torch.zeros(max_recv, cfg.hidden_dim, dtype=input.dtype, device=dev)
        send_x[:n] = payload
        send_w = torch.zeros(max_recv, K, dtype=torch.float32, device=dev)
        if weights is not None:
            send_w[:n] = weights[:n]
        send_src = torch.full((max_recv, 2), -1, dtype=torch.int64, device=dev)
        send_src[:n] = self._recv_src
        all_x = _all_gather_bytes(send_x, W)
        all_w = _all_gather_bytes(send_w, W)
        all_src = _all_gather_bytes(send_src, W)

        T = indices.shape[0]
        out = self._buf("combine_x", (P, cfg.hidden_dim), input.dtype, dev)
        out_w = self._buf("combine_w", (P, K), torch.float32, dev)
        acc = torch.zeros(T, cfg.hidden_dim, dtype=torch.float32, device=dev)
        acc_w = torch.zeros(T, K, dtype=torch.float32, device=dev)
        for t in range(T):
            pes = sorted({int(e) // cfg.num_experts_per_rank for e in indices[t].tolist()})
            for pe in pes:
                hit = ((all_src[pe][:, 0] == cfg.rank) & (all_src[pe][:, 1] == t)).nonzero().flatten()
                if hit.numel() != 1:
                    raise RuntimeError(f"mori combine: token {t} was not dispatched to PE {pe}")
                acc[t] += all_x[pe][hit[0]].float()
                acc_w[t] += all_w[pe][hit[0]]
        out[:T] = acc.to(input.dtype)
        out_w[:T] = acc_w
        self._state = "combined"
        self.calls["combine"] += 1
        if call_reset:
            self.reset()
        return out, (out_w if weights is not None else None)

    def reset(self) -> None:
        self._state = "idle"
        self.calls["reset"] += 1


def make_modules(arch: str) -> dict[str, types.ModuleType]:
    """Fake ``mori`` package modules for ``sys.modules``, emulating ``arch``."""
    import functools

    shmem = _Shmem()
    root = types.ModuleType("mori")
    root.__path__ = []
    ops = types.ModuleType("mori.ops")
    ops.EpDispatchCombineConfig = EpDispatchCombineConfig
    ops.EpDispatchCombineKernelType = EpDispatchCombineKernelType
    ops.EpDispatchCombineOp = functools.partial(EpDispatchCombineOp, _shmem=shmem, _arch=arch)
    root.ops = ops
    root.shmem = shmem.module
    root.EMULATED_ARCH = arch
    return {"mori": root, "mori.ops": ops, "mori.shmem": shmem.module}

"""Float64 of what AITER's ``fused_moe`` computes for the core's schemes on each architecture
(TEST SUPPORT ONLY): the "exact definition" the ``aiter`` backend is compared with.

The ``aiter`` adapter hands the kernel the core scheme's GEMM1 input (amax/448 e4m3fn, per 1x128
group for ``fp8_block``, per token for ``fp8_per_token``; bit-exact as fnuz on gfx942) and the
checkpoint's weights (exact in either flavour). The kernel then requantizes the intermediate
activation (the GEMM2 input) itself, with the same grouping, on the architecture's FP8 grid:
e4m3fnuz, amax/240 on gfx942; e4m3fn, amax/448 on gfx950. So on gfx950 the definition is the core
scheme's; on gfx942 it differs in that one rounding, which is why the core reference and gfx942
differ by ~3% (two valid roundings), while each matches its own definition closely.

Written from that description with ``moe_core.reference.oracle`` (float64 loops, float64 FP8
round trips); it shares no code with the emulated kernel or the plugin.
"""

from __future__ import annotations

import torch

from moe_core import quant
from moe_core.contracts import Activation, QuantScheme
from moe_core.reference.oracle import fp8_round_trip, moe_float64

ARCH_FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
GROUP = {QuantScheme.FP8_BLOCK: 128, QuantScheme.FP8_PER_TOKEN: None}  # None: one scale per token


def aiter_float64(scheme: QuantScheme, arch: str, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  ckpt: dict, *, routed_scaling_factor: float = 1.0,
                  activation: Activation = Activation.SILU) -> torch.Tensor:
    """``x [T, H]``: the activations as they reach the experts (the wire's dequantized values);
    ``ids``: expert ids into ``ckpt``'s experts, -1 skipped. Returns float64 ``[T, H]``."""
    scheme = QuantScheme(scheme)
    w13, w2 = quant.dequantize_weights(ckpt, scheme)
    qa = None
    if scheme is not QuantScheme.UNQUANTIZED:
        group, grid = GROUP[scheme], ARCH_FP8[arch]

        def qa(v, which, e):
            return fp8_round_trip(v, group) if which == "a13" else fp8_round_trip(v, group, dtype=grid)

    return moe_float64(x, weights, ids, w13, w2, activation=activation,
                       routed_scaling_factor=routed_scaling_factor, quantize_activation=qa)

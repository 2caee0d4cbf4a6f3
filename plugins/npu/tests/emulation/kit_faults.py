"""A deliberately wrong emulated op, to show that the conformance kit's fused EP cases can fail
(test support only; installed by the kit's ``setup`` hook in spawned workers)."""

from __future__ import annotations

import npu_emulation
from npu_emulation import deep_ep_ascend


def install_misweighted_fused() -> None:
    """The emulated stack, with ``fused_deep_moe`` scaling the top-k weights by 0.9 (a 10% error)."""
    right = deep_ep_ascend.Buffer.fused_deep_moe

    def fused_deep_moe(self, x, topk_idx, topk_weights, *args, **kwargs):
        return right(self, x, topk_idx, topk_weights * 0.9, *args, **kwargs)

    deep_ep_ascend.Buffer.fused_deep_moe = fused_deep_moe  # a spawned worker's own copy of the module
    npu_emulation.install_into_process()

"""Expert parallelism over ``torch.distributed`` (gloo on CPU, NCCL on NVIDIA, HCCL via torch_npu).

``TorchA2ADispatcher`` (backend ``torch_a2a``) moves tokens to the ranks that own their experts
with ``all_to_all_single`` and back again; see ``moe_core.distributed.torch_a2a``.
"""

from moe_core.distributed.torch_a2a import TorchA2ADispatcher, check, probe

__all__ = ["TorchA2ADispatcher", "check", "probe"]

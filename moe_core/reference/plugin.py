"""The built-in plugin: core backends, declared exactly as a third-party plugin would."""

from __future__ import annotations

from moe_core.backends import BackendSpec, EPSupport, Role
from moe_core.contracts import Activation, Format, QuantScheme, WireDtype
from moe_core.devices import DEVICE_KINDS
from moe_core.plugin_base import BackendPlugin

ALL_DEVICES = frozenset(DEVICE_KINDS)


class ReferencePlugin(BackendPlugin):
    def backends(self) -> list[BackendSpec]:
        return [
            BackendSpec(
                name="standard", role=Role.DISPATCHER, impl="moe_core.reference.dispatcher:StandardDispatcher",
                formats=(Format.STANDARD,), devices=ALL_DEVICES,
                wire_dtypes=(WireDtype.BF16, WireDtype.FP8, WireDtype.INT8, WireDtype.NVFP4),
                graph_safe_formats=frozenset({Format.STANDARD}), ep=EPSupport.ANY, priority=0,
                check="moe_core.reference.dispatcher:check",
                description="no communication; under EP: the layer gathers every rank's tokens, local-id "
                            "remap, all-reduce of the output",
            ),
            BackendSpec(
                name="torch_a2a", role=Role.DISPATCHER, impl="moe_core.distributed.torch_a2a:TorchA2ADispatcher",
                formats=(Format.EP_NORMAL, Format.EP_MASKED), devices=ALL_DEVICES,  # RCCL on ROCm
                wire_dtypes=(WireDtype.BF16, WireDtype.FP8, WireDtype.INT8),
                graph_safe_formats=frozenset({Format.EP_MASKED}), graph_safe_on_request=frozenset({Format.EP_NORMAL}),
                ep=EPSupport.REQUIRED, priority=10, check="moe_core.distributed.torch_a2a:check",
                description="expert parallelism over torch.distributed all-to-all (gloo, NCCL, HCCL); normal mode "
                            "with worst-case buffers under cuda_graph",
            ),
            BackendSpec(
                name="reference", role=Role.EXPERTS, impl="moe_core.reference.experts:ReferenceExperts",
                formats=(Format.STANDARD, Format.EP_NORMAL, Format.EP_MASKED), devices=ALL_DEVICES,
                wire_dtypes=(WireDtype.BF16, WireDtype.FP8, WireDtype.INT8, WireDtype.NVFP4),
                quant_schemes=frozenset(QuantScheme), activations=frozenset(Activation),
                graph_safe_formats=frozenset(), ep=EPSupport.ANY, priority=0, expert_bias=True, keeps_loaded_weights=True,
                description="pure PyTorch, every format and scheme; the oracle (syncs with the host)",
            ),
        ]


plugin = ReferencePlugin()

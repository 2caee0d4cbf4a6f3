"""moe-plugin-npu: Huawei Ascend backends for moe-core (``npu_gmm``, ``deepep_npu``, ``fuseep``).

Vendor libraries (torch_npu, DeepEP for Ascend) are imported lazily by the implementations and
probes; importing this package works on any machine.
"""

__version__ = "0.1.0"

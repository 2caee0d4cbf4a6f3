"""The ``cutlass`` experts: grouped GEMMs on SM90 (CUTLASS's or DeepGEMM's) around the Triton kernels, and the
CUTLASS library they build (``csrc/``)."""

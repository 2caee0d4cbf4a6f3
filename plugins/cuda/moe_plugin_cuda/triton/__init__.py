"""The Triton fused-MoE pipeline: kernels, launchers, tuned launch tables and the ``triton`` experts."""

"""DeepGEMM's SM90 grouped GEMMs behind our own C ABI (``csrc/``), launched by the ``cutlass`` experts."""

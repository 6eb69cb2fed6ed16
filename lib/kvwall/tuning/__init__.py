"""Layer 3: tuners that write the kernels' tuned tables (``python -m kvwall.tuning.gather`` /
``python -m kvwall.tuning.fused`` on a GPU)."""

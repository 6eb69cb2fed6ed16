"""Layer 1 of the library: how the book measures (timers, profiler, ncu, compute-sanitizer, accuracy).

Imports nothing of the project above ``kvwall.kernels``; every experiment times with these.
"""

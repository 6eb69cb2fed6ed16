"""Layer 1 of the library: how the book measures.

- :mod:`.timing`: the stopwatches (device time, CUDA-graph replays, host time per call, phase clock) and the
  roofline's two ceilings (copy bandwidth, BF16 matmul rate);
- :mod:`.profiler`: ``torch.profiler`` reduced to op and kernel tables; the synchronizing operations of a call;
- :mod:`.ncu`: Nsight Compute over one kernel launch; :mod:`.sanitizer`: compute-sanitizer memcheck as a row;
- :mod:`.accuracy`: relative error against float64, bit equality of BF16 outputs;
- :mod:`.failures`: a failure as the fields of a recorded row.

Imports nothing of the project; every experiment measures with these.
"""

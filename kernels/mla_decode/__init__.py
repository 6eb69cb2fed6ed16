"""Fused FP8 MLA decode (chapter 5): attention straight from the FP8 pool, never materializing BF16.

- :mod:`.kernel`: the Triton split-KV and combine kernels, their launcher (``mla_decode_fp8``) and its per-step
  plan (``plan_mla_decode``: a balanced work list reused by every layer), the tuned launch shapes' lookup
  (``tuned_entry``) and the fallback shapes filtered by what the device fits (``fallback_config``);
- :mod:`.plan`: the work list's host arithmetic (``build_work_list``);
- :mod:`.reference`: the torch reference (``mla_decode_reference``), the seeded input generator
  (``make_mla_inputs``) and the float64 reference on the dequantized cache (``reference64``);
- :mod:`.cases`: the validation case table every check (tests, recorded run, sanitizer) uses;
- :mod:`.sanitize`: what ``compute-sanitizer`` runs (``python -m kvwall.kernels.mla_decode.sanitize``);
- ``tuned.json``: launch shapes per GPU, head count and context (``python -m kvwall.tuning.fused --write``);
- :mod:`.cuda`: the CUDA C++ mma.sync path (``mla_decode_fp8_cuda``, sm_89+; ``mla_decode_mma.cu``);
- :mod:`.wgmma`: the CUDA C++ warpgroup-MMA path for H100 / H200 (``mla_decode_fp8_wgmma``, sm_90a;
  ``mla_decode_wgmma.cu``); both include ``mla_decode_common.cuh``;
- :mod:`.dispatch`: which of the three paths runs a call (``choose_path``, ``mla_decode``), from ``paths.json``.
"""

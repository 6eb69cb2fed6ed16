"""Fused FP8 MLA decode (chapter 5): attention straight from the FP8 pool, never materializing BF16.

- :mod:`.kernel`: the Triton split-KV and combine kernels and their launcher (``mla_decode_fp8``);
- :mod:`.reference`: the torch reference (``mla_decode_reference``), the seeded input generator;
- ``tuned.json``: launch shapes per GPU and head count.
"""

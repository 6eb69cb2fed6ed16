"""Gather-then-cast (chapter 4): cast only the KV rows a page table references, FP8 -> BF16.

- :mod:`.kernel`: the Triton kernels (``gather_cast``, ``full_cast``) and their launcher;
- :mod:`.cuda` + ``gather_cast.cu``: the CUDA C++ twin;
- :mod:`.reference`: the torch reference and the seeded input generator;
- :mod:`.cases`: the validation case table every check (tests, recorded run, sanitizer) uses;
- :mod:`.sanitize`: what ``compute-sanitizer`` runs (``python -m kvwall.kernels.gather.sanitize``);
- ``tuned.json``: launch shapes per GPU (``python -m kvwall.tuning.gather --write``); ``NOTES.md``: the working notes.
"""

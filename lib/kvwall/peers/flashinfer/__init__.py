"""FlashInfer as a peer, driven as it ships.

* Releases side by side: :mod:`.releases` (install into a per-release cache, offline wheelhouse),
  :mod:`.errors`, :mod:`.progress` (a bar on a terminal).
* Their JIT builds, on the CPU: :mod:`.build` (the MLA kernel, per release and config),
  :mod:`.generator_build` (any JIT generator of the importable FlashInfer), :mod:`.toolchain`
  (nvcc), :mod:`.nvcc_errors` (the compiler's words, parsed), :mod:`.sources` (the release's own
  C++ lines).
* Its MLA doors with an FP8 cache: :mod:`.doors` (the table and the matrix), :mod:`.citations`
  (the source lines that decide them), :mod:`.calls` (calling them), :mod:`.replay` (their checks
  as on another GPU family).
* Subprocess entry points, run with ``python -m`` and a release first on ``sys.path``:
  :mod:`.jit_driver` (checks and builds), :mod:`.replay`, :mod:`.patch_driver` (the patch on a GPU).
"""

"""Layer 3: other people's kernels and libraries, driven as they ship (FlashInfer releases and
their MLA doors, SGLang's Triton MLA decode)."""

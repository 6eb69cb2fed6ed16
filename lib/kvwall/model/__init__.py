"""Layer 2: the serving model the book measures (MLA geometry, roofline, token pool, KV strategies,
the attention wrapper, the decode step, the original investigation's figures)."""

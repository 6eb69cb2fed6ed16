"""FlashInfer as a peer: releases installed side by side, their JIT builds, their MLA entry points."""

"""What the notebooks use that the engine does not: the simulator's capacity and disaggregation
models, the radix tree (SGLang's prefix cache, to compare with the hash chain) and FlashDecoding's
split-K reference. Nothing in the engine imports from here."""

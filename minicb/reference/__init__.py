"""What the notebooks use that the engine does not: the simulator's capacity and disaggregation
models, the radix tree (SGLang's prefix cache, to compare with the hash chain), FlashDecoding's
split-K reference and the expert-parallel load balancer (EPLB's redundant experts, eplb.py).
Nothing in the engine imports from here."""

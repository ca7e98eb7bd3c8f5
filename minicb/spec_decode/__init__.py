"""Speculative decoding (vLLM V1: vllm/v1/spec_decode/): the n-gram (prompt lookup) proposer and the
bookkeeping of drafts between two steps."""

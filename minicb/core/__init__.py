"""The engine's core, in pure Python (vLLM V1: vllm/v1/core/): requests and their states, the
scheduler and its policies, the block manager with its prefix-cache hash chain, and the checks
that refuse a request before it can do harm. No torch here: it is drawn and tested without a
model."""

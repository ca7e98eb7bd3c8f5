"""From logits to tokens (vLLM V1: vllm/v1/sample/): the sampler, penalties and logit processors,
logprobs, and the rejection sampler that verifies speculative drafts."""

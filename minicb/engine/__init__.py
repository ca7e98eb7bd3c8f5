"""The engine loop and its front ends (vLLM V1: vllm/v1/engine/ and vllm/entrypoints/llm.py):
Engine (add_request / step / abort), the offline LLM, input processing (tokenize, check) and output
processing (detokenize, stop strings, RequestOutput)."""

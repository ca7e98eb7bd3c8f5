"""The model itself (vLLM: vllm/model_executor/): the Llama-family forward pass, its attention paths
(gather, ragged, paged in place), the fp8 KV quantizer, weight loading (embedded GGUF, Hugging Face
directories, tiny random models) and the CPU matmul kernels."""

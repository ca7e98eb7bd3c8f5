"""What runs the model on a device (vLLM V1: vllm/v1/worker/): the worker that sets it up, the model
runner (SchedulerOutput -> flat tensors -> logits -> tokens), the paged KV cache, memory sizing,
CUDA-graph decode and tensor parallelism."""

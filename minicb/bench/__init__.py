"""Benchmarks: every speed figure minicb quotes comes from one of these workloads, with every
competitor run side by side in the same process, on the same model, prompts and output lengths.
Quote ratios of one run; an absolute tokens/s holds only for the machine it was taken on (each
table names it). `python -m minicb bench --workload w1|w2|w3|all` runs them (cli.py).

W1, mixed-length chat on the CPU (w1.py), the headline:
  - the embedded SmolLM2-135M-Instruct, float32, CPU, as many torch threads as cores;
  - 64 requests, all arriving at time 0, built in this order with one `rng = random.Random(0)`:
    per request `topic = rng.choice(["the sea", "gravity", "bread", "Rome", "a cat", "rain",
    "chess", "music", "trains", "the moon", "coffee", "volcanoes"])`, then
    `q = f"Tell me about {topic}." + " Please be detailed." * rng.randint(0, 6)`, then the output
    length `min(256, max(4, int(rng.lognormvariate(3.5, 0.9))))`; the prompt is `q` as one user
    message in the chat template with the generation prompt (35-60 tokens). 3,920 output tokens in
    all (mean ~61, longest 256). EOS is ignored, so every system produces exactly these lengths;
  - throughput = output tokens / wall time from the first submission to the last completion (loading
    excluded), with TTFT and TPOT percentiles;
  - competitors: transformers `generate` in static batches of 16 (left padding), transformers'
    continuous batching, minicb static (16 slots), minicb continuous at 16 slots (the scheduler's
    own gain over static at the same batch size) and at its default 64 slots (what paging adds);
    opt-in, minicb in dtype "auto" (bfloat16 where the CPU has it natively and it is faster), minicb
    with int8 weights, and llama.cpp's llama-server on the same token ids through its /completion
    endpoint, at the best weight type x slots of a sweep (llamacpp.py); a row in another precision
    than float32 carries its teacher-forced agreement with float32 (precision.py);
  - roofline: the machine's measured float32 GEMM peak against the decode step's 2 x params FLOPs
    per token.

W2, the offline workload nano-vllm and vLLM report (w2.py, needs a CUDA GPU):
  256 requests, prompt and output lengths each uniform in 100..1024, random token ids, EOS ignored,
  a Qwen3-0.6B-shaped model; output tokens/s, with and without CUDA graphs.

W3, scheduler overhead, model-free (w3.py):
  the real Scheduler with N requests all decoding and a scripted model: CPU time per step in
  schedule() + update() (+ the trace, + the runner's host-side input lists). This is the cost that
  sits on the critical path between two GPU steps.
"""

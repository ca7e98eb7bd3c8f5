"""Measuring what a step costs on this machine: the five numbers of config.StepCost, fitted from
real steps of the engine when it starts (a profile run, as vLLM profiles memory before serving).

The scheduler's time target (core/step_cost.py) is only as good as its model of a step's time, and
that model differs from machine to machine: attention's cost per position of context against the
linear layers' cost per token depends on the kernels, the cores and the memory bandwidth. So the
engine runs a few requests of random token ids through itself and times every step:

    a long prompt fed in chunks of CHUNK tokens       -> steps at context 0, CHUNK, 2 CHUNK, ...
                                                         (token_s, context_token_s)
    short chunks (1, 16, 64 tokens) deep in that      -> what a chunk pays per position of context
    prompt, re-using its cached prefix                   whatever its length (position_s)
    a prompt with prompt log-probabilities           -> logits_row_s
    a few requests decoding side by side             -> step_s (one token each: the fixed cost
                                                         dominates)

The short chunks are cheap to place deep in the prompt because the prefix cache holds it: a
request whose prompt is the long prompt's first c tokens plus k new ones computes only those k, at
context c.

Noise on a shared machine only ever adds time, so of steps with the same rows the fastest is kept
(the short chunks are run twice); least squares over the rest gives the five numbers (each at least
0). It takes a few times as long as prefilling the long prompt: about 10 s for SmolLM2-135M on two
CPU cores, and it runs only when `max_decode_slowdown` is set without a `step_cost` (a server; an
engine in a test gets its numbers given, so that its schedule is the same on every machine).
"""

import torch

from ..config import StepCost
from ..core.async_scheduler import scheduler_for
from ..core.scheduler import Scheduler
from ..sampling_params import SamplingParams
from ..trace import Trace

CHUNK = 256  # tokens per step of the long prompt (the calibration's token budget)
LONG = 2048  # the long prompt's tokens, at most (within max_model_len and half the KV cache)
SHORT_CHUNKS = (1, 16, 64)  # chunks placed deep in the long prompt
DEPTHS = 4  # ... at this many contexts, evenly spaced up to the long prompt's end
REPEATS = 2  # each short chunk is run this many times: the fastest of equal steps is kept
NUM_DECODERS = 4  # requests decoding side by side
WARMUP = 2 * CHUNK  # a first prompt (untimed) allocates and picks kernels for the steps' shapes


def features(rows, with_logits: set[str]) -> list[float]:
    """One step's regressors: (1, tokens, attended positions, extra LM-head rows, positions
    read)."""
    tokens = sum(r.num_tokens for r in rows)
    attended = sum(r.num_tokens * r.start + r.num_tokens * (r.num_tokens + 1) // 2 for r in rows)
    logits_rows = sum(r.num_tokens for r in rows if r.request_id in with_logits and r.is_prefill)
    read = sum(r.start + r.num_tokens for r in rows)
    return [1.0, float(tokens), float(attended), float(logits_rows), float(read)]


def calibrate_step_cost(engine, seed: int = 0) -> StepCost:
    """Fit a StepCost from timed steps of `engine`, then leave it as it was (an empty scheduler and
    trace). Call it before the engine has requests of its own."""
    if engine.has_unfinished_requests():
        raise RuntimeError("calibrate_step_cost needs an idle engine: it runs requests of its own")
    config = engine.config
    # no time target, and the prefix cache on: the short chunks re-use the long prompt's prefix
    calib = config.replace(
        max_num_batched_tokens=CHUNK,
        max_decode_slowdown=None,
        record_trace=True,
        enable_prefix_caching=True,
        async_scheduling=False,  # each step timed alone (the engine runs them so until it is done)
    )
    counters = (engine._next_id, engine._num_added)  # request ids and arrival order: restored
    engine.scheduler = Scheduler(calib)
    engine.trace = Trace(calib.max_num_seqs, calib.num_blocks, calib.block_size)
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size

    def random_prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def run(prompt: list[int], params: SamplingParams) -> str:
        rid = engine.add_request(prompt, params)
        run_to_end(engine)
        return rid

    bs = config.block_size
    room = min((config.max_model_len or 10**9) - 8, config.num_blocks * bs // 2) - max(SHORT_CHUNKS)
    long_len = max(bs, min(LONG, room) // bs * bs)  # whole blocks: every short chunk's prefix hits
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    run(random_prompt(min(WARMUP, long_len)), greedy)
    first = len(engine.trace.steps)  # the steps before this one are not timed
    long_prompt = random_prompt(long_len)
    run(long_prompt, greedy)
    depths = sorted({long_len * (i + 1) // DEPTHS // bs * bs for i in range(DEPTHS)} - {0})
    for _ in range(REPEATS):
        for context in depths or [long_len]:
            for k in SHORT_CHUNKS:  # the prefix is cached: only the k new tokens are computed
                run(long_prompt[:context] + random_prompt(k), greedy)
    with_logits = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    logit_ids = {run(random_prompt(min(2 * CHUNK, long_len)), with_logits)}
    decoding = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for _ in range(NUM_DECODERS):
        engine.add_request(random_prompt(16), decoding)
    run_to_end(engine)
    fastest: dict[tuple, float] = {}  # a step's regressors -> its fastest time
    for step in engine.trace.steps[first:]:
        key = tuple(features(step.rows, logit_ids))
        fastest[key] = min(step.duration, fastest.get(key, step.duration))
    x = torch.tensor(list(fastest), dtype=torch.float64)
    y = torch.tensor([[t] for t in fastest.values()], dtype=torch.float64)
    fit = torch.linalg.lstsq(x, y).solution.flatten().clamp(min=0).tolist()
    # back to the engine's own scheduler and trace, untouched by the calibration
    engine.scheduler = scheduler_for(config)
    engine.trace = Trace(config.max_num_seqs, config.num_blocks, config.block_size)
    engine._next_id, engine._num_added = counters
    return StepCost(*fit)


def run_to_end(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()

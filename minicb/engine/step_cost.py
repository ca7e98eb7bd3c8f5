"""Measuring what a step costs on this machine: the four numbers of config.StepCost, fitted from
real steps of the engine when it starts (a profile run, as vLLM profiles memory before serving).

The scheduler's time target (core/step_cost.py) is only as good as its model of a step's time, and
that model differs from machine to machine: attention's cost per position of context against the
linear layers' cost per token depends on the kernels, the cores and the memory bandwidth. So the
engine runs a few requests of random token ids through itself, with a small token budget so that
one long prompt is fed in equal chunks at growing context, and times every step:

    a prompt fed in chunks of k tokens       -> a step at context 0, k, 2k, ...  (token_s,
                                                context_token_s)
    the same with prompt log-probabilities   -> logits_row_s
    a few requests decoding side by side     -> step_s (one token each: the fixed cost dominates)

Noise on a shared machine only ever adds time, so of steps with the same rows (the same chunk at
the same context, fed twice) the fastest is kept; least squares over the rest gives the four
numbers (each at least 0). It takes about as long
as prefilling the calibration prompts: seconds on a small CPU model, and it runs only when
`max_decode_slowdown` is set without a `step_cost` (a server; an engine in a test gets its numbers
given, so that its schedule is the same on every machine).
"""

import torch

from ..config import StepCost
from ..core.scheduler import Scheduler
from ..sampling_params import SamplingParams
from ..trace import Trace

CHUNK = 64  # tokens fed per step while calibrating
NUM_CHUNKS = 8  # chunks of the calibration prompt: contexts 0 to 448
REPEATS = 2  # the plain prompt is fed this many times: the fastest of equal steps is kept
NUM_DECODERS = 4  # requests decoding side by side
WARMUP_STEPS = 2  # the first steps allocate and pick kernels: not timed


def features(rows, with_logits: set[str]) -> list[float]:
    """One step's regressors: (1, tokens, attended positions, extra LM-head rows)."""
    tokens = sum(r.num_tokens for r in rows)
    attended = sum(r.num_tokens * r.start + r.num_tokens * (r.num_tokens + 1) // 2 for r in rows)
    logits_rows = sum(r.num_tokens for r in rows if r.request_id in with_logits and r.is_prefill)
    return [1.0, float(tokens), float(attended), float(logits_rows)]


def calibrate_step_cost(engine, seed: int = 0) -> StepCost:
    """Fit a StepCost from timed steps of `engine`, then leave it as it was (an empty scheduler and
    trace). Call it before the engine has requests of its own."""
    if engine.has_unfinished_requests():
        raise RuntimeError("calibrate_step_cost needs an idle engine: it runs requests of its own")
    config = engine.config
    # a small token budget and no time target: every chunk has CHUNK tokens
    calib = config.replace(
        max_num_batched_tokens=CHUNK,
        max_decode_slowdown=None,
        record_trace=True,
        enable_prefix_caching=False,
    )
    counters = (engine._next_id, engine._num_added)  # request ids and arrival order: restored
    engine.scheduler = Scheduler(calib)
    engine.trace = Trace(calib.max_num_seqs, calib.num_blocks, calib.block_size)
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size

    def random_prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    prompt_len = min(CHUNK * NUM_CHUNKS, (config.max_model_len or 10**9) - 8)
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with_logits = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    decoding = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    logit_ids = set()
    for params in [greedy] * REPEATS + [with_logits]:
        rid = engine.add_request(random_prompt(prompt_len), params)
        if params is with_logits:
            logit_ids.add(rid)
        run_to_end(engine)
    for _ in range(NUM_DECODERS):
        engine.add_request(random_prompt(CHUNK // NUM_DECODERS), decoding)
    run_to_end(engine)
    fastest: dict[tuple, float] = {}  # a step's regressors -> its fastest time
    for step in engine.trace.steps[WARMUP_STEPS:]:
        key = tuple(features(step.rows, logit_ids))
        fastest[key] = min(step.duration, fastest.get(key, step.duration))
    x = torch.tensor(list(fastest), dtype=torch.float64)
    y = torch.tensor([[t] for t in fastest.values()], dtype=torch.float64)
    fit = torch.linalg.lstsq(x, y).solution.flatten().clamp(min=0).tolist()
    # back to the engine's own scheduler and trace, untouched by the calibration
    engine.scheduler = Scheduler(config)
    engine.trace = Trace(config.max_num_seqs, config.num_blocks, config.block_size)
    engine._next_id, engine._num_added = counters
    return StepCost(*fit)


def run_to_end(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()

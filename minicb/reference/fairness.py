"""Each tenant's share of the service over time, read from a Trace (the simulator's or the
engine's): what a notebook draws to compare first come, first served with the Virtual Token Counter
(core/fairness.py, Sheng et al., OSDI 2024).

Service is counted as the paper counts it: w_p per prompt token, w_q per output token (1 and 2, its
weights). This is read from what the steps did, not from the scheduler's counters, so it checks
them: a prompt token counts once, in the first step whose row reaches it (a prefix-cache hit counts:
the paper's cost is of tokens, not of work; a recompute after preemption computes it again, and is
not service again), and a token the engine sampled counts in the step that sampled it (one more for
each draft kept).
"""

from ..core.fairness import INPUT_TOKEN_WEIGHT, OUTPUT_TOKEN_WEIGHT
from ..trace import Trace


def served_per_step(
    trace: Trace,
    requests: dict[str, tuple[str | None, int]],
    input_weight: float = INPUT_TOKEN_WEIGHT,
    output_weight: float = OUTPUT_TOKEN_WEIGHT,
) -> dict[str | None, list[float]]:
    """{tenant: weighted tokens served to it in each step of `trace.steps`}. `requests`: each
    request's tenant and prompt length by id, e.g. `{r.request_id: (r.user, r.prompt_len) for r in
    sim_result.requests}`. The other samples of an n-sample request ("1_<id>", ...) count for their
    first sample's tenant (their first tokens, sampled by its row, are not seen in the trace)."""
    served = {user: [0.0] * len(trace.steps) for user, _ in requests.values()}
    computed = {}  # request id -> positions served so far (the highest + 1)
    finished = set()  # requests finished in an earlier step (async scheduling: extra rows)
    for i, record in enumerate(trace.steps):
        for row in record.rows:
            if row.request_id in finished:
                continue  # an async extra row: its token was dropped
            user, prompt_len, is_sample = _tenant(requests, row.request_id)
            # a fork shares its first sample's prompt: none of it is served to it again
            done = computed.get(row.request_id, prompt_len if is_sample else 0)
            end = row.start + row.num_tokens
            new_prompt_tokens = max(0, min(end, prompt_len) - done)  # (a cache hit's too)
            computed[row.request_id] = max(done, end)
            new_output_tokens = 1 + row.num_accepted if row.sampled else 0
            served[user][i] += input_weight * new_prompt_tokens + output_weight * new_output_tokens
        finished.update(record.finished)
    return served


def tenant_shares(
    trace: Trace,
    requests: dict[str, tuple[str | None, int]],
    window: int | None = None,
    input_weight: float = INPUT_TOKEN_WEIGHT,
    output_weight: float = OUTPUT_TOKEN_WEIGHT,
) -> dict[str | None, list[float]]:
    """{tenant: its share of the weighted tokens served, at each step of `trace.steps`}: over the
    `window` steps ending there, or from the first step when `window` is None. A step whose window
    served nothing has no share: NaN (a gap in a plot). `requests`: as served_per_step takes it."""
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1 step (or None: from the start), got {window}")
    served = served_per_step(trace, requests, input_weight, output_weight)
    totals = _running_sums([sum(column) for column in zip(*served.values())])
    shares = {}
    for user, tokens in served.items():
        mine = _running_sums(tokens)
        shares[user] = []
        for i in range(len(tokens)):
            first = 0 if window is None else max(0, i + 1 - window)
            total = totals[i + 1] - totals[first]
            shares[user].append((mine[i + 1] - mine[first]) / total if total else float("nan"))
    return shares


def _running_sums(values: list[float]) -> list[float]:
    """[0, v0, v0 + v1, ...]: the sum over steps [a, b) is sums[b] - sums[a]."""
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return sums


def _tenant(requests: dict, request_id: str) -> tuple[str | None, int, bool]:
    """(tenant, prompt length, is another sample of an n-sample request) of a row's request."""
    if request_id in requests:
        return *requests[request_id], False
    first_sample = request_id.split("_", 1)[-1]  # vLLM's sample ids: "<index>_<request id>"
    if first_sample not in requests:
        raise ValueError(f"request {request_id!r} of the trace is not in `requests`")
    return *requests[first_sample], True

"""Fairness between tenants: the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving
Large Language Models" (OSDI 2024), as `scheduling_policy="vtc"` (the paper's policy; vLLM has no
such policy, minicb adds it).

A tenant is whoever a request's `user` names (OpenAI's field; requests without one are one tenant,
None). First come, first served lets a tenant that floods the queue take the batch. VTC instead
counts the service each tenant has received, in weighted tokens: w_p per prompt (input) token, w_q
per generated (output) token, the paper's cost h(n_p, n_q) = w_p * n_p + w_q * n_q. Its rules:
  - admission: the waiting request of the tenant with the smallest counter comes first (first come,
    first served within a tenant). Its whole prompt is charged when it is admitted, before the next
    pick, as the paper's Algorithm 2 charges a request it adds to the batch: one step's admissions
    already alternate between tenants;
  - every generated token charges w_q to its tenant, after the step that produced it;
  - the counter lift: a tenant with no request in the queue that sends one has its counter raised
    to the smallest counter among the tenants in the queue (when the queue is empty, to the counter
    of the tenant that left it last: the paper's Algorithm 2; its artifact lifts only in the first
    case), never lowered. Without it a tenant idle for an hour would come back far below the
    others and take the whole batch until it caught up: credit banked while idle. With it, it is
    served fairly from the moment it is back, and never less than fairly.
The paper proves that two tenants backlogged over the same period receive service that differs by a
bounded amount, however long the period: each gets an equal share of the weighted tokens.

Weights: w_p = 1, w_q = 2, those of the paper's evaluation (the VTCReqQueue of its artifact,
github.com/Ying1123/VTC-artifact, slora/server/router/vtc_req_queue.py, defaults to input_price=1,
output_price=2): an output token, computed alone in a decode step, costs twice an input token.

What minicb adds where the paper has nothing to follow (S-LoRA reserves a request's whole output, so
it never preempts, and computes a prompt in one piece):
  - the queue is the waiting and the swapped requests; a swapped request coming back leaves it;
  - when blocks run out, the running request of the tenant with the largest counter is preempted
    (the one VTC would serve last; among one tenant's, the latest to arrive);
  - a prompt is charged once, at its first admission, whole even when chunked prefill computes it
    over several steps (or a prefix cache hit spares it: the paper's cost counts tokens, not work).
    A request preempted by recompute is not charged again: recomputing is the engine's cost, not
    service the tenant receives. An aborted request stops being charged (it gets no more tokens);
    what it was charged stays.
"""

from .request import Request

INPUT_TOKEN_WEIGHT = 1.0  # w_p: the paper's evaluation
OUTPUT_TOKEN_WEIGHT = 2.0  # w_q: an output token costs twice an input one
# Counters kept at most for tenants with nothing in the engine. A server's clients name tenants
# freely, and a counter for every name ever seen would grow without bound. Past this many, idle
# tenants are forgotten, those at or below the lift's floor first (that changes nothing: they would
# come back at the floor anyway), then the longest known; one of those, back, starts at the floor
# as a newcomer does, its excess service forgotten: a bounded error traded for bounded memory.
MAX_IDLE_TENANTS = 4096


class VirtualTokenCounter:
    """The counters of VTC, one per tenant, and the three moments they change: a tenant's request
    arrives (the lift), a request is admitted (its prompt), a step samples tokens (its outputs)."""

    def __init__(
        self, input_weight: float = INPUT_TOKEN_WEIGHT, output_weight: float = OUTPUT_TOKEN_WEIGHT
    ):
        if input_weight < 0 or output_weight < 0:
            raise ValueError(
                f"VTC's weights must be >= 0, got input {input_weight} and output {output_weight}"
            )
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.counters: dict[str | None, float] = {}  # tenant -> weighted tokens served (and lifts)
        # the tenant whose request left the queue last (None before any has: every counter is 0)
        self.last_left: str | None = None

    def counter(self, user: str | None) -> float:
        return self.counters.get(user, 0.0)

    def key(self, req: Request) -> tuple[float, int]:
        """The scheduler's sort key: the least served tenant first, then arrival within it."""
        return self.counter(req.user), req.arrival_index

    def on_arrival(
        self, user: str | None, queued: list[Request], running: list[Request] = ()
    ) -> None:
        """A request of `user` arrives; `queued` is the queue before it (waiting and swapped). The
        counter lift: a tenant not in the queue starts level with the least served one in it.
        `running`: the requests in the batch (their tenants are never forgotten)."""
        queued_users = {r.user for r in queued}
        if user in queued_users:
            return  # backlogged already: its counter runs on
        floor = min(map(self.counter, queued_users), default=self.counter(self.last_left))
        self.counters[user] = max(self.counter(user), floor)
        active = queued_users | {r.user for r in running} | {user, self.last_left}
        if len(self.counters) > len(active) + MAX_IDLE_TENANTS:
            self._forget_idle(active, floor)

    def _forget_idle(self, active: set, floor: float) -> None:
        """Down to half the bound of idle tenants: those at or below `floor` first, then the
        longest known (a dict keeps its keys in the order they came)."""
        idle = [u for u in self.counters if u not in active]
        by_need = sorted(idle, key=lambda u: self.counters[u] > floor)  # stable: oldest first
        for u in by_need[: len(idle) - MAX_IDLE_TENANTS // 2]:
            del self.counters[u]

    def charge(self, admitted: list[Request], sampled: list[Request]) -> None:
        """Service just given: requests admitted (their prompts, w_p each token, at the first
        admission only) and sequences that received tokens (w_q each)."""
        for req in admitted:
            self.last_left = req.user
            if req.num_preemptions == 0:  # a recompute or a swap-in comes after a preemption
                served = self.input_weight * req.num_prompt_tokens
                self.counters[req.user] = self.counter(req.user) + served
        for seq in sampled:
            served = self.output_weight * seq.num_new_tokens
            self.counters[seq.user] = self.counter(seq.user) + served

    def __repr__(self):
        shown = ", ".join(f"{user!r}: {c:g}" for user, c in sorted(self.counters.items(), key=str))
        return (
            f"VirtualTokenCounter(w_p={self.input_weight:g}, w_q={self.output_weight:g}, "
            f"counters={{{shown}}})"
        )

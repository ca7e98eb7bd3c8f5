"""AsyncScheduler (vLLM V1's name and file, vllm/v1/core/sched/async_scheduler.py): the scheduler
of `async_scheduling`, where step N+1 is scheduled before step N's sampled tokens are back.

Scheduler counts a step's work once it has run (update()). Here it is counted when the step is
scheduled: its rows' tokens as computed, and each token it samples as an output placeholder
(`Request.num_output_placeholders`), so that the next schedule() already sees the request one token
longer and gives it a decode row whose input is that placeholder (the executor feeds it from step
N's sampled tokens: worker/executor.py). update() then only settles: the placeholder becomes the
token, and drafts the step rejected are taken back.

What the scheduler cannot know before the tokens land, it does not guess:
  - a request whose row forks its n samples sits out the next step (its samples are not requests
    yet); so does one whose in-flight tokens already reach max_tokens (vLLM skips it too);
  - drafts, whose number kept decides where the next row starts, are refused with async
    scheduling (config.py), as vLLM V1 refuses its CPU ngram proposer.
A request that finishes in step N (EOS, a stop string) was already scheduled for N+1: that row runs,
its token is dropped by update(), and its blocks were freed once, when it finished.
"""

from .request import Request, RequestStatus
from .scheduler import Scheduler
from .scheduler_output import ScheduledRequest, SchedulerOutput


class AsyncScheduler(Scheduler):
    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        for row in out.scheduled:
            req = row.request
            req.num_computed_tokens += row.num_tokens
            req.spec_token_ids = []  # the row holds its drafts
            if row.do_sample:
                req.num_output_placeholders += 1
                req.waits_for_step = bool(req.forks)

    def _may_schedule(self, req: Request) -> bool:
        all_in_flight = req.num_output_tokens + req.num_output_placeholders >= req.params.max_tokens
        return not req.waits_for_step and not all_in_flight

    def _count_computed(self, req: Request, row: ScheduledRequest, rejected: int) -> None:
        if row.do_sample:  # its token has landed: no longer a placeholder
            req.num_output_placeholders -= 1
            req.waits_for_step = False
        if req.status != RequestStatus.WAITING:  # (preempted by recompute: 0 already)
            req.num_computed_tokens -= rejected  # counted when scheduled: only rejects go back


def scheduler_for(config) -> Scheduler:
    """The scheduler a config asks for (vLLM's SchedulerConfig.get_scheduler_cls)."""
    return (AsyncScheduler if config.async_scheduling else Scheduler)(config)

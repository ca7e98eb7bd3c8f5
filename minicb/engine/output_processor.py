"""OutputProcessor: from the engine's requests to what a user sees (vLLM's name, and vLLM's split).

A step ends with the requests that got a token. Turning them into RequestOutputs is a job of its
own, which vLLM runs in its API-server process, apart from the engine core that schedules and
steps. It keeps, per request:
  - the samples: a request with n samples is one RequestOutput holding n CompletionOutputs;
  - the text, detokenized incrementally (detokenizer.py), where stop strings are found: the
    engine then finishes that sample (`Engine._stop`);
  - the log-probabilities asked for, each entry with its token's text;
and it hands out snapshots: an output never changes after it is returned. Its books on a request
close with the request's last output.
"""

from ..core.request import Request
from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..sampling_params import RequestOutputKind
from .detokenizer import IncrementalDetokenizer, StopStrings, new_detokenizer


class OutputProcessor:
    def __init__(self, tokenizer):
        # None for a model without one: outputs then carry token ids only
        self.tokenizer = tokenizer
        self.samples: dict[str, list[Request]] = {}  # request id -> its samples, in index order
        self.owner: dict[str, str] = {}  # sample id -> its request's id
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}  # sample id -> its growing text

    def add_request(self, samples: list[Request]) -> None:
        """Open the books on a request (samples[0]) that the scheduler accepted."""
        request_id = samples[0].request_id
        self.samples[request_id] = samples
        # indexed once per request: its samples share the stop strings
        stop = StopStrings(samples[0].params.stop or ()) if self.tokenizer is not None else None
        for sample in samples:
            self.owner[sample.request_id] = request_id
            if self.tokenizer is not None:
                p = sample.params
                self.detokenizers[sample.request_id] = new_detokenizer(
                    self.tokenizer, stop, p.include_stop_str_in_output, min_tokens=p.min_tokens
                )

    def sample(self, sample_id: str) -> Request | None:
        request_id = self.owner.get(sample_id)
        return (
            None
            if request_id is None
            else next(s for s in self.samples[request_id] if s.request_id == sample_id)
        )

    def add_prompt_logprobs(self, found: dict[str, list[dict[int, Logprob]]]) -> None:
        for sample_id, entries in found.items():
            if sample_id in self.owner:
                self.sample(sample_id).prompt_logprobs += map(self._decoded, entries)

    def add_token(
        self, req: Request, logprobs: dict[int, Logprob] | None, index: int = -1
    ) -> str | None:
        """Take the sample's token at `index` of its token ids (the newest by default; a step that
        accepted drafts hands them over in order) and its log-probabilities, if asked. Returns the
        stop string its text now contains, if any: the engine must finish the sample."""
        token, last = req.token_ids[index], index in (-1, req.num_tokens - 1)
        if req.logprobs is not None:
            req.logprobs.append(self._decoded(logprobs))
            req.cumulative_logprob += logprobs[token].logprob
        detokenizer = self.detokenizers.get(req.request_id)
        if detokenizer is None:
            return None
        detokenizer.add([token], finished=req.is_finished and last)
        return detokenizer.stop_reason

    def _decoded(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """Fill in each Logprob's decoded_token (the token's own text) when there is a tokenizer."""
        if self.tokenizer is not None:
            for token, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([token])
        return entry

    def make_outputs(self, touched: list[Request], finished: list[Request]) -> list[RequestOutput]:
        """One output per request that got a token or finished this step (its last only, for
        output_kind FINAL_ONLY); the books close on the requests whose every sample has finished."""
        got_token = {req.request_id for req in touched}
        # in order, each once
        ids = dict.fromkeys(self.owner[r.request_id] for r in touched + finished)
        outputs = [
            self.output(request_id, got_token)
            for request_id in ids
            if self.wants_output(self.samples[request_id])
        ]
        for out in outputs:
            if out.finished:
                for sample in self.samples.pop(out.request_id):
                    del self.owner[sample.request_id]
                    self.detokenizers.pop(sample.request_id, None)
        return outputs

    @staticmethod
    def wants_output(samples: list[Request]) -> bool:
        """Is an output handed out for this request now (every step, or its last for FINAL_ONLY)?"""
        final_only = samples[0].params.output_kind == RequestOutputKind.FINAL_ONLY
        return not final_only or all(s.is_finished for s in samples)

    def output(self, request_id: str, got_token: set[str] = frozenset()) -> RequestOutput:
        """A snapshot of a request and all its samples (copies: later steps never change it).
        `got_token`: the samples whose newest token is new in this step."""
        samples = self.samples[request_id]
        first, finished = samples[0], all(s.is_finished for s in samples)
        outputs = []
        for sample in samples:
            text, detokenizer = "", self.detokenizers.get(sample.request_id)
            if detokenizer is not None:
                if sample.is_finished:
                    # flush a character held back (an abort, an error)
                    detokenizer.add([], finished=True)
                text = detokenizer.visible_text(sample.is_finished)
            new = (
                sample.token_ids[sample.num_tokens - sample.num_new_tokens :]
                if sample.request_id in got_token
                else []
            )
            outputs.append(
                CompletionOutput(
                    sample.sample_index,
                    text,
                    sample.output_token_ids,
                    sample.cumulative_logprob,
                    None if sample.logprobs is None else list(sample.logprobs),
                    sample.finish_reason,
                    sample.stop_reason,
                    new,
                )
            )
        if finished:  # the request ends with its last sample
            first.metrics.finish_time = max(s.metrics.finish_time or 0.0 for s in samples) or None
        prompt_logprobs = None if first.prompt_logprobs is None else list(first.prompt_logprobs)
        error = next((s.error for s in samples if s.error), None)
        return RequestOutput(
            request_id,
            first.prompt,
            first.prompt_token_ids,
            prompt_logprobs,
            outputs,
            finished,
            first.metrics.snapshot(),
            error,
            first.num_cached_tokens if first.num_cached_tokens >= 0 else None,
        )

"""InputProcessor: a user's prompt and SamplingParams become the Requests the engine core schedules.

vLLM runs this in its API-server process, before anything reaches the engine core: tokenize the
prompt, check what the parameters need of this model (a tokenizer for stop strings, token ids inside
the vocabulary), and make one Request per sample of an n-sample request (samples 1..n-1 wait inside
the first and fork after its prefill, Scheduler.fork). A request refused here never reaches the
core.
"""

import time

from ..config import EngineConfig
from ..core.limits import check_request
from ..core.request import Request
from ..sampling_params import SamplingParams
from ..structured_output import check_structured_outputs


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        model_name: str,
    ):
        self.config = config  # resolved: max_model_len and num_blocks known
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.model_name = model_name

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"model {self.model_name!r} has no tokenizer: pass token ids instead of text"
                )
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = list(prompt)
        bad = [
            t
            for t in ids
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise ValueError(
                f"token ids must be integers in [0, {self.vocab_size}) (the vocabulary), got "
                f"{bad[:5]}"
            )
        return ids

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        priority: int,
        request_id: str,
        taken=(),
    ) -> list[Request]:
        """The samples of one request (the first is the request itself), or ValueError naming the
        problem. `taken`: ids in use (a sample id must be new)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self.tokenize(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"stop strings are found in text, and model {self.model_name!r} has no tokenizer"
            )
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(
                f"logit_bias token ids must be in [0, {self.vocab_size}) (the vocabulary), "
                f"got {max(params.logit_bias)}"
            )
        check_request(self.config, len(ids), params.max_tokens, priority, params.n)
        so = params.structured_outputs
        check_structured_outputs(so, self.tokenizer, self.vocab_size, self.eos_token_ids)
        # vLLM's child ids
        sample_ids = [request_id] + [f"{i}_{request_id}" for i in range(1, params.n)]
        if any(sid in taken for sid in sample_ids):
            raise ValueError(
                f"request id {request_id!r} (or one of its samples' ids) is already in use"
            )
        samples = [
            Request(
                sid,
                ids,
                params.for_sample(i),
                priority,
                eos_token_ids=self.eos_token_ids,
                prompt=prompt if isinstance(prompt, str) else None,
                sample_index=i,
            )
            for i, sid in enumerate(sample_ids)
        ]
        samples[0].forks = samples[1:]
        samples[0].metrics.arrival_time = time.perf_counter()
        return samples

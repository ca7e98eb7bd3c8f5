"""Engine: the loop that ties scheduler, model runner and trace together (LLM, the offline API, is llm.py).

    Engine.step():  scheduler.schedule()  -> which requests run, how many tokens each
                    runner.execute(out)   -> one forward pass over all of them, sampled tokens
                    scheduler.update()    -> append tokens, stop finished requests, free blocks
                    trace.record()        -> what the step did, for the notebooks
Everything a user sees (generate, stream, the HTTP server) is this loop called again and again.
"""

import logging
import time

import torch

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kv_cache import KVCache, kv_bytes_per_token
from .loader import LoadedModel, load_model
from .cpu_kernels import prepack_for_cpu
from .model import CausalLM
from .model_runner import ModelRunner
from .request import CompletionOutput, Request, RequestOutput, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .trace import Trace

log = logging.getLogger("minicb.engine")

DEFAULT_KV_CACHE_BYTES = 512 * 2**20  # 512 MiB: ~11k tokens of SmolLM2-135M in float32


def resolve_config(config: EngineConfig, loaded: LoadedModel) -> EngineConfig:
    """Fill in what depends on the model: max_model_len and num_blocks (from a byte budget)."""
    max_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
    num_blocks = config.num_blocks
    if num_blocks is None:
        per_block = kv_bytes_per_token(loaded.hf_config, getattr(torch, config.dtype)) * config.block_size
        num_blocks = (config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} is smaller than one KV block "
                             f"({per_block} bytes for block_size={config.block_size})")
    return config.replace(max_model_len=max_len, num_blocks=num_blocks)


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        dtype = getattr(torch, config.dtype)
        loaded = loaded or load_model(config.model, dtype)
        self.config = config = resolve_config(config, loaded)
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.vocab_size = loaded.vocab_size
        self.model_name = loaded.name
        model = CausalLM.from_hf(loaded.hf_config, loaded.state_dict, dtype, config.device)
        if config.prepack_cpu_weights and dtype == torch.float32 and torch.device(config.device).type == "cpu":
            model = prepack_for_cpu(model)
        self.kv_cache = KVCache(loaded.hf_config, config.num_blocks, config.block_size, dtype, config.device,
                                config.num_swap_blocks)
        self.scheduler = Scheduler(config)
        self.runner = ModelRunner(model, self.kv_cache, config, config.device)
        use_graph = config.use_cuda_graph is True or (
            config.use_cuda_graph == "auto" and torch.device(config.device).type == "cuda")
        if use_graph:
            from .cuda_graph import DecodeGraphRunner

            self.runner.graph_runner = DecodeGraphRunner(self.runner)
        self.trace = Trace(config.max_num_seqs, config.num_blocks, config.block_size)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}  # request id -> its growing text
        self._next_id = 0  # for request ids chosen by the engine
        self._num_added = 0  # arrival order (FIFO key)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_name!r} has no tokenizer: pass token ids instead of text")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = list(prompt)
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be integers in [0, {self.vocab_size}) (the vocabulary), got {bad[:5]}")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids). Raises ValueError, changing nothing, if it can never run."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self.tokenize(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings are found in text, and model {self.model_name!r} has no tokenizer")
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        req = Request(request_id, ids, params, priority, arrival_index=self._num_added,
                      eos_token_ids=self.eos_token_ids, prompt=prompt if isinstance(prompt, str) else None)
        req.metrics.arrival_time = time.perf_counter()
        self.scheduler.add_request(req)
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop or (),
                                                                    params.include_stop_str_in_output)
        self._num_added += 1
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort_request(request_id)
        if req is None:
            return None
        req.metrics.finish_time = time.perf_counter()
        return self._output(req, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _fail(self, request_id: str, why: str) -> None:
        """Stop one request whose own inputs broke this step; everything else keeps running."""
        req = self.scheduler.abort_request(request_id, RequestStatus.FINISHED_ERROR)
        if req is not None:
            req.error = why
            req.metrics.finish_time = time.perf_counter()
            log.error("request %s failed and was stopped: %s", request_id, why)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns a RequestOutput for every request that got a token, and for
        every request that finished without one since the last step (aborted)."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        for rid in out.admitted:
            req = self.scheduler.requests[rid]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t0
        try:
            tokens, errors = self.runner.execute(out)
        except Exception as e:  # the forward pass itself failed: its rows cannot be told apart
            log.exception("step %d failed; stopping the %d requests it ran", out.step, len(out.scheduled))
            tokens = [None] * sum(row.do_sample for row in out.scheduled)
            errors = {row.request.request_id: e for row in out.scheduled}
        for rid, e in errors.items():  # those requests stop here; update() drops their tokens
            self._fail(rid, f"{type(e).__name__}: {e}")
        touched = self.scheduler.update(out, [0 if t is None else t for t in tokens])
        now = time.perf_counter()
        outputs = []
        for req in touched:
            req.metrics.record_token(now)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if req.is_finished:
                req.metrics.finish_time = now
            try:
                self._detokenize(req)
                outputs.append(self._output(req, [req.token_ids[-1]]))
            except Exception as e:  # e.g. its text cannot be decoded: it fails alone
                self._fail(req.request_id, f"{type(e).__name__}: {e}")
        finished = self.scheduler.take_finished()
        got_token = {req.request_id for req in touched}
        outputs += [self._output(req, []) for req in finished if req.request_id not in got_token]
        for req in finished:  # their last output is made: the text is complete
            self._detokenizers.pop(req.request_id, None)
        if self.config.record_trace:
            self.trace.record(self.scheduler, out, finished, self.runner.last_graph_bucket, now - t0)
        return outputs

    def _detokenize(self, req: Request) -> None:
        """Add the newest token to the request's text; a stop string found there finishes it."""
        detokenizer = self._detokenizers.get(req.request_id)
        if detokenizer is None:
            return
        detokenizer.add([req.token_ids[-1]], finished=req.is_finished)
        if detokenizer.stop_reason is not None and req.status != RequestStatus.FINISHED_STOPPED:
            if req.is_finished:  # it reached max_tokens in the same step: the stop string wins
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.abort_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            req.stop_reason = detokenizer.stop_reason
            req.metrics.finish_time = time.perf_counter()

    def _output(self, req: Request, new_token_ids: list[int]) -> RequestOutput:
        """A snapshot of `req` for the user (copies: later steps never change it)."""
        out_ids = req.output_token_ids
        detokenizer = self._detokenizers.get(req.request_id)
        text = ""
        if detokenizer is not None:
            if req.is_finished:
                detokenizer.add([], finished=True)  # flush a character held back (an abort, an error)
            text = detokenizer.visible_text(req.is_finished)
        sample = CompletionOutput(index=0, text=text, token_ids=out_ids, finish_reason=req.finish_reason,
                                  stop_reason=req.stop_reason, new_token_ids=new_token_ids)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, None, [sample],
                             req.is_finished, req.metrics.snapshot(), req.error)

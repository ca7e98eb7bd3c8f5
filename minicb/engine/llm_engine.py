"""Engine: the loop that ties scheduler, model runner and output processor together (LLM is llm.py).

    Engine.step():  scheduler.schedule()  -> which requests run, how many tokens each
                    runner.execute(out)   -> one forward pass over all of them, sampled tokens
                    scheduler.update()    -> append tokens, fork n samples, stop finished requests
                    output_processor      -> text, stop strings, logprobs: RequestOutputs (and a
                    trace record)
Everything a user sees (generate, stream, the HTTP server) is this loop called again and again.
"""

import collections
import gc
import logging
import time
import warnings

import torch

from ..config import EngineConfig
from ..core.async_scheduler import scheduler_for
from ..core.request import Request, RequestStatus
from ..model_executor.cpu_kernels import kernel_cache_file
from ..model_executor.cpu_precision import resolve_dtype
from ..model_executor.loader import LoadedModel, load_model
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..spec_decode.ngram_proposer import NgramProposer, propose_drafts
from ..structured_output import StructuredOutputManager
from ..trace import StepTimes, Trace
from ..worker.memory import resolve_config
from ..worker.model_runner import ModelRunnerOutput, host_inputs
from ..worker.worker import Worker
from .batch_queue import BatchQueue
from .input_processor import InputProcessor
from .output_processor import OutputProcessor
from .step_cost import calibrate_step_cost

log = logging.getLogger("minicb.engine.llm_engine")


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        if config.dtype == "auto":  # timed once per machine (model_executor/cpu_precision.py)
            loaded = loaded or load_model(config.model, torch.float32)
            dtype = resolve_dtype("auto", config.device, loaded.hf_config, kernel_cache_file())
            config = config.replace(dtype=dtype)
        dtype = getattr(torch, config.dtype)
        loaded = loaded or load_model(config.model, dtype)
        converts_dtype = loaded.dtype is not None and loaded.dtype != dtype
        if converts_dtype:  # never silently: exactness depends on it
            warnings.warn(
                f"minicb: the model was loaded in {str(loaded.dtype).removeprefix('torch.')}; "
                f"the engine converts its weights to {config.dtype} (EngineConfig.dtype)",
                stacklevel=2,
            )
        self.config = config = resolve_config(config, loaded)
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = eos = loaded.eos_token_ids
        self.vocab_size = loaded.vocab_size
        self.model_name = loaded.name
        # weights, KV cache, model runner and graphs on the device (worker.py)
        worker = Worker(config, loaded)
        # with num_blocks, when the cache was sized from the GPU
        self.config = config = worker.config
        self.tp = worker.tp
        self.cpu_kernels = worker.cpu_kernels
        self.memory = worker.memory
        self.kv_cache = worker.kv_cache
        self.runner = worker.runner
        self.scheduler = scheduler_for(config)
        self.trace = Trace(config.max_num_seqs, config.num_blocks, config.block_size)
        # the last steps' StepTimes, kept whether or not the trace records (benchmarks read them)
        self.step_times = collections.deque(maxlen=1024)
        self.input_processor = InputProcessor(
            config, self.tokenizer, self.vocab_size, self.eos_token_ids, self.model_name
        )
        # text, logprobs, samples -> outputs
        self.output_processor = OutputProcessor(self.tokenizer)
        # drafts proposed after each step, verified in the next (spec_decode.py)
        spec = config.speculative_config
        self.proposer = NgramProposer(spec) if spec else None
        # structured outputs: grammars compiled off the loop, their requests held until ready
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, eos)
        self._next_id = 0  # for request ids chosen by the engine
        # async scheduling: steps run on the executor's thread, one in flight (batch_queue.py);
        # made after the step-cost calibration below, which times steps one at a time
        self.batch_queue: BatchQueue | None = None
        self._num_added = 0  # arrival order (FIFO key)
        needs_step_cost = config.max_decode_slowdown is not None and config.step_cost is None
        if needs_step_cost:  # the scheduler's time target needs this machine's step times
            self.config = config = config.replace(step_cost=calibrate_step_cost(self))
            self.scheduler = scheduler_for(config)
            log.info("minicb: measured this machine's step time: %r", config.step_cost)
        if config.async_scheduling:
            self.batch_queue = BatchQueue(self)
        # vLLM V1's freeze_gc_heap (EngineCore.__init__): what is alive now (the libraries, the
        # tokenizer, the model's modules) leaves the collector's reach, so its full passes stop
        # scanning it between steps (a sixth of a step's host time at batch 256, measured on CPU).
        # Only the young generations are collected first: a full pass takes 0.3 s.
        gc.collect(1)
        gc.freeze()

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        request_id: str | None = None,
        user: str | None = None,
    ) -> str:
        """Queue a prompt (text or token ids). Raises ValueError, changing nothing, if it can never
        run. `user`: its tenant (OpenAI's field), whom scheduling_policy="vtc" serves fairly."""
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        samples = self.input_processor.make_request(
            prompt, params, priority, request_id, self.output_processor.owner
        )
        for sample in samples:
            sample.user = user
        self.add_samples(samples)
        return request_id

    def add_samples(self, samples: list[Request]) -> None:
        """Queue a request already made by an InputProcessor (here, or in a server's API
        process)."""
        for sample in samples:
            sample.arrival_index = self._num_added  # arrival order here: the FIFO key
        if samples[0].params.structured_outputs is None:
            self.scheduler.add_request(samples[0])  # refuses (changing nothing) what never runs
        else:  # queued once its grammar is compiled (make_request checked that it compiles)
            self.structured.hold(samples)
        self.output_processor.add_request(samples)
        self._num_added += 1

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request, all its samples included. Returns its last output, None if unknown."""
        samples = self.output_processor.samples.get(request_id)
        if samples is None:
            return None
        if self.structured.drop(samples, self.scheduler):  # its grammar was not ready yet
            return self.output_processor.output(request_id)
        # samples not forked yet finish with the first one (Scheduler._finish)
        for sample in samples:
            if self.scheduler.abort_request(sample.request_id) is not None:
                sample.metrics.finish_time = time.perf_counter()
        return self.output_processor.output(request_id)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (a no-op otherwise, and when called twice)."""
        self.structured.shutdown()
        if self.batch_queue is not None:  # async scheduling: its thread finishes what it started
            self.batch_queue.shutdown()
        if self.tp is not None:
            self.tp.shutdown()
        gc.unfreeze()  # unlike vLLM's one engine a process, a test or a benchmark makes many

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self.structured.waiting)
            or (self.batch_queue is not None and self.batch_queue.in_flight is not None)
        )

    def _fail(self, request_id: str, why: str) -> None:
        """Stop one sample whose own inputs broke this step; everything else keeps running."""
        req = self.scheduler.abort_request(request_id, RequestStatus.FINISHED_ERROR)
        sample = self.output_processor.sample(request_id)
        is_unforked_sample = req is None and sample is not None and not sample.is_finished
        if is_unforked_sample:  # it was to fork: Scheduler.fork skips it
            req = sample
            sample.status = RequestStatus.FINISHED_ERROR
        if req is not None:
            req.error = why
            req.metrics.finish_time = time.perf_counter()
            log.error("request %s failed and was stopped: %s", request_id, why)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns a RequestOutput for every request that got a token, and for
        every request that finished without one since the last step (aborted). With async
        scheduling the tokens are those of the step before, processed while this one runs."""
        if self.batch_queue is not None:
            return self.batch_queue.step()
        times = StepTimes(schedule_start=time.perf_counter())
        out = self._schedule(times)
        h = host_inputs(out, self.config.block_size) if out.scheduled else None
        times.launch = times.device_start = time.perf_counter()
        bucket = width = None

        def before_sampling():
            times.forward_end = times.sample_start = time.perf_counter()

        try:
            result = self.runner.execute(out, h, before_sampling)
            bucket, width = self.runner.last_graph_bucket, self.runner.last_graph_width
        except Exception as e:  # the forward pass itself failed: its rows cannot be told apart
            result = self._failed_step(out, e)
        times.queued = times.device_end = time.perf_counter()
        return self._process(out, result, times, bucket, width)

    def drain(self) -> list[RequestOutput]:
        """Async scheduling: process the step in flight and launch no other (LLM.generate ends with
        it, so no device work outlives it). Returns its outputs; [] with synchronous steps."""
        return self.batch_queue.drain() if self.batch_queue is not None else []

    def _schedule(self, times: StepTimes):
        if self.structured.waiting:  # structured outputs: queue the requests whose grammar is ready
            self.structured.queue_ready(self.scheduler)
        out = self.scheduler.schedule()
        for rid in out.admitted:
            req = self.scheduler.requests[rid]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = times.schedule_start
        return out

    def _failed_step(self, out, e: Exception) -> ModelRunnerOutput:
        log.error(
            "step %d failed; stopping the %d requests it ran",
            out.step,
            len(out.scheduled),
            exc_info=e,
        )
        return ModelRunnerOutput(
            [None] * sum(r.request.num_seqs for r in out.scheduled if r.do_sample),
            errors={row.request.request_id: e for row in out.scheduled},
        )

    def _process(self, out, result, times: StepTimes, bucket, width, row_tables=None):
        """After the model ran: update the scheduler, then text, stop strings and outputs."""
        times.outputs_start = time.perf_counter()
        for rid, e in result.errors.items():  # those samples stop here; update() drops their tokens
            self._fail(rid, f"{type(e).__name__}: {e}")
        self.output_processor.add_prompt_logprobs(result.prompt_logprobs)
        touched = self.scheduler.update(
            out, [0 if t is None else t for t in result.sampled_token_ids], result.accepted_drafts
        )
        now = time.perf_counter()
        for req, why in self.structured.advance(touched, self.scheduler):
            self._fail(req.request_id, why)
        for req in touched:
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if req.is_finished:
                req.metrics.finish_time = now
            try:
                self._add_tokens(req, result.logprobs.get(req.request_id))
            except Exception as e:  # e.g. its text cannot be decoded: it fails alone
                self._fail(req.request_id, f"{type(e).__name__}: {e}")
            # more than one when drafts were accepted: they come out together
            for _ in range(req.num_new_tokens):
                req.metrics.record_token(now)
        times.detokenize_s = time.perf_counter() - now
        finished = self.scheduler.take_finished()
        if self.proposer is not None:  # drafts for the next step (spec_decode.py)
            propose_drafts(self.proposer, touched, finished)
        outputs = self.output_processor.make_outputs(touched, finished)
        times.outputs_end = time.perf_counter()
        self.step_times.append(times)
        if self.config.record_trace:
            self.trace.record(
                self.scheduler,
                out,
                finished,
                bucket,
                times.outputs_end - times.schedule_start,
                width,
                result.accepted_drafts,
                times,
                row_tables,
                result.expert_load,
                result.expert_traffic,
            )
        return outputs

    def _add_tokens(self, req: Request, logprobs) -> None:
        """Hand the step's new tokens to the output processor, one by one: the first that completes
        a stop string finishes the sample, and drafts accepted past it are dropped, as if they had
        never been generated."""
        for i in range(req.num_tokens - req.num_new_tokens, req.num_tokens):
            # a stop token on the last one wins
            stop_string = self.output_processor.add_token(req, logprobs, i)
            stops_here = stop_string is not None and (
                i < req.num_tokens - 1 or req.status != RequestStatus.FINISHED_STOPPED
            )
            if stops_here:
                req.num_new_tokens -= req.num_tokens - 1 - i
                del req.token_ids[i + 1 :]
                self._stop(req, stop_string)
                return

    def _stop(self, req: Request, stop_string: str) -> None:
        """Finish a sample whose text reached one of its stop strings."""
        if req.is_finished:  # it reached max_tokens in the same step: the stop string wins
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.abort_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        req.stop_reason = stop_string
        req.metrics.finish_time = time.perf_counter()

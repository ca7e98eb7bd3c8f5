"""The engine core in a process of its own, as vLLM runs it (`python -m minicb serve`'s default).

    API-server process (HTTP, asyncio)                     engine-core process (its main thread)
    InputProcessor: text -> token ids -> Requests  --add-->   Engine.add_samples
    a client leaves / a stop string is found     --abort-->   Engine.abort_request / Scheduler
    OutputProcessor: detokenize, stop strings,   <--step---   Engine.step(): each sample's new token
      logprobs' text -> RequestOutputs -> SSE                 ids, finish reason, logprobs; KV stats

The core only schedules and steps; it never decodes text. The API process keeps HTTP, JSON,
tokenization, detokenization and the streams, and a mirror of every request (the same Request
objects, grown from the core's messages), so its OutputProcessor works as it does in one process.
Messages are pickled tuples on a multiprocessing Pipe. A core that dies is noticed: the next
step() raises, the server fails the requests in flight and reports the engine dead (AsyncEngine's
fatal_error). The core keeps only the newest `trace_steps` step records, as the engine in the API
process does: a server runs for days, and a trace that keeps every step grows without bound.
RemoteEngine offers the methods of Engine that the server's engine loop (engine_loop.py) calls, so
the loop runs the same code whether the engine is in this process (tests, notebooks) or not.
"""

import multiprocessing as mp
import os
import signal
import time
import weakref
from multiprocessing.connection import wait

from ..config import EngineConfig
from ..core.request import Request, RequestStatus
from ..engine.input_processor import InputProcessor
from ..engine.output_processor import OutputProcessor
from ..outputs import RequestOutput
from ..structured_output import warm_ll_tokenizer
from .metrics import server_stats

# step() waits this long for the core's next message, then lets the loop read its inbox (a wake()
# ends the wait at once)
STEP_WAIT_S = 0.05


class RemoteEngine:
    def __init__(
        self,
        config: EngineConfig,
        startup_timeout_s: float = 600.0,
        core_threads: int | None = None,
        trace_steps: int | None = 1000,
    ):
        """`core_threads`: torch's intra-op threads in the core (default: torch's own, one per
        core). `trace_steps`: step records the core's trace keeps, the newest (None: all of them,
        for a short run that draws its whole trace; 1000, AsyncEngine's default, for a server)."""
        # a fresh interpreter: no threads, locks or torch state inherited
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # A daemonic process may start no children: with tensor parallelism the core starts its
        # workers.
        self.process = ctx.Process(
            target=run_engine_core,
            args=(child, config, core_threads, trace_steps),
            name="minicb-engine-core",
            daemon=config.tensor_parallel_size == 1,
        )
        self.process.start()
        child.close()  # the core holds its end; if it dies, recv() here raises EOFError
        if not self._conn.poll(startup_timeout_s):
            self.process.kill()
            raise RuntimeError(f"the engine core did not start within {startup_timeout_s:.0f} s")
        kind, info = self._conn.recv()
        if kind != "ready":
            raise RuntimeError(f"the engine core failed to start: {info}")
        self.config, self.tokenizer, self.model_name = (
            info["config"],
            info["tokenizer"],
            info["model_name"],
        )
        self.core_threads = info["threads"]  # torch's intra-op threads in the core process
        self.input_processor = InputProcessor(
            self.config, self.tokenizer, info["vocab_size"], info["eos_token_ids"], self.model_name
        )
        # structured outputs: the check of a request's constraint needs llguidance's view of the
        # tokenizer (~1 s to build): built now, off the engine loop's thread
        warm_ll_tokenizer(self.tokenizer, info["vocab_size"], info["eos_token_ids"])
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats, self.last_step_rows, self.last_step_preempted = info["stats"], 0, 0
        self.stepped = False  # did the last step() see a step of the core?
        self.dead = False  # set once step() has reported the core's death
        # aborted here: their last output comes with the next step
        self._finished_here: list[Request] = []
        self._next_id = 0
        # wake(): a byte here ends step()'s wait, so that a request arriving while the core runs
        # step N reaches it before N + 1 (vLLM V1's client sends at once too), not after N's
        # outputs came back, when the core had begun N + 1 already. Closed with this object only.
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
            weakref.finalize(self, os.close, fd)

    # ------------------------------------------------------------------ Engine's methods
    def tokenize(self, prompt) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def add_request(
        self,
        prompt,
        params=None,
        priority: int = 0,
        request_id: str | None = None,
        user: str | None = None,
    ) -> str:
        """Check and make the request here (ValueError, nothing sent, if it can never run), then
        send it; `user` (the tenant) travels with the request."""
        if request_id is None:
            request_id, self._next_id = str(self._next_id), self._next_id + 1
        samples = self.input_processor.make_request(
            prompt, params, priority, request_id, self.output_processor.owner
        )
        for sample in samples:
            sample.user = user
        self._send("add", samples)
        self.output_processor.add_request(samples)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        samples = self.output_processor.samples.get(request_id)
        if samples is None:
            return None
        now = time.perf_counter()
        for sample in samples:
            if not sample.is_finished:
                sample.status, sample.metrics.finish_time = RequestStatus.FINISHED_ABORTED, now
                self._finished_here.append(sample)
        self._send("abort", request_id)
        return self.output_processor.output(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished here, or a message from the core still to read (its latest stats).
        Once the core is dead there is nothing to step: the loop must not spin on a closed pipe."""
        if self.dead:
            return False
        return bool(self.output_processor.samples) or self._conn.poll(0)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor.samples)

    def is_alive(self) -> bool:
        return not self.dead and self.process.is_alive()

    def _died(self) -> RuntimeError:
        self.dead = True
        self.process.join(1.0)  # reap it, so that its exit code is known
        return RuntimeError(f"the engine core process died (exit code {self.process.exitcode})")

    def wake(self) -> None:
        """Thread-safe: end a step() that waits for the core now (the loop has commands for it)."""
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:  # the pipe is full of wake-ups: one is pending already
            pass

    def step(self) -> list[RequestOutput]:
        """The outputs of the core's next step, or of nothing new if it sent nothing within
        STEP_WAIT_S or wake() was called meanwhile (requests aborted here still get their last
        output). Raises RuntimeError if the core died."""
        touched, finished = [], self._finished_here
        self._finished_here, self.stepped = [], False
        ready = wait([self._conn, self._wake_r], STEP_WAIT_S)
        woken = self._wake_r in ready
        if woken:  # every pending wake-up (any left over end one more wait early: harmless)
            os.read(self._wake_r, 4096)
        if self._conn in ready:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                raise self._died() from None
            if kind == "error":  # the core's loop broke and its process exits: it is dead too
                self.dead = True
                raise RuntimeError(f"the engine core failed: {payload}")
            if kind == "stats":  # an abort freed blocks while the core had nothing to step
                self.stats = payload
            else:
                (
                    deltas,
                    prompt_logprobs,
                    self.stats,
                    self.last_step_rows,
                    self.last_step_preempted,
                ) = payload
                self.stepped = True
                self.output_processor.add_prompt_logprobs(prompt_logprobs)
                for delta in deltas:
                    self._apply(delta, touched, finished)
        elif not woken and not self.process.is_alive():
            raise self._died()
        return self.output_processor.make_outputs(touched, finished)

    def _apply(self, delta, touched: list[Request], finished: list[Request]) -> None:
        """Grow the mirror of one sample from the core's message, then detokenize here."""
        sample_id, new_token_ids, status, stop_reason, error, logprobs, now = delta
        sample = self.output_processor.sample(sample_id)
        if sample is None or sample.is_finished:  # aborted or stopped here already
            return
        sample.num_new_tokens = 0  # several when the core kept drafts (speculative decoding)
        for i, (token, entry) in enumerate(
            zip(new_token_ids, logprobs or [None] * len(new_token_ids))
        ):
            sample.token_ids.append(token)
            sample.num_new_tokens += 1
            sample.metrics.record_token(now)
            sample.metrics.first_token_time = sample.metrics.first_token_time or now
            last = i == len(new_token_ids) - 1
            if (
                last and status is not None
            ):  # the core finished it with this token (a stop token wins, as there)
                sample.status, sample.stop_reason, sample.error = (
                    RequestStatus(status),
                    stop_reason,
                    error,
                )
                sample.metrics.finish_time = now
            stop_string = self.output_processor.add_token(sample, entry)
            if stop_string is not None and not (
                last and sample.status == RequestStatus.FINISHED_STOPPED
            ):
                sample.status, sample.stop_reason, sample.metrics.finish_time = (
                    RequestStatus.FINISHED_STOPPED,
                    stop_string,
                    now,
                )
                self._send("stop", sample_id)  # the core frees its blocks
                break  # tokens past the stop string are dropped, as Engine._add_tokens drops them
        if not new_token_ids:
            if status is not None:
                sample.status, sample.stop_reason, sample.error = (
                    RequestStatus(status),
                    stop_reason,
                    error,
                )
                sample.metrics.finish_time = now
            finished.append(sample)
            return
        touched.append(sample)

    def _send(self, *message) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, OSError):  # the core is gone: step() reports it
            pass

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._send("shutdown")
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            # reap it: is_alive() stays true until the killed process is waited for
            self.process.join()


# ---------------------------------------------------------------------- the core process
def run_engine_core(
    conn, config: EngineConfig, threads: int | None = None, trace_steps: int | None = None
) -> None:
    """The core's main loop: take every waiting message, step while there is work, send each step's
    deltas. Blocks on the pipe when idle. Exits when the API process closes its end or says so.
    `threads` sets torch's intra-op threads in this process only (the API process needs a core
    too); `trace_steps` bounds the step records its trace keeps (RemoteEngine)."""
    import torch

    # imported here: the API process never loads torch's model code for it
    from ..engine.llm_engine import Engine

    # Ctrl-C in a terminal reaches the whole process group. The API process owns the shutdown (it
    # says "shutdown", or its end of the pipe closes): a core that died of the signal first would
    # look like a crash to it (AsyncEngine.fatal_error) and the server would exit as if failed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        engine = Engine(config)
        engine.trace.max_steps = trace_steps
        engine.output_processor = OutputProcessor(None)  # the API process detokenizes
        conn.send(
            (
                "ready",
                {
                    "config": engine.config,
                    "tokenizer": engine.tokenizer,
                    "model_name": engine.model_name,
                    "vocab_size": engine.vocab_size,
                    "eos_token_ids": engine.eos_token_ids,
                    "stats": server_stats(engine),
                    "threads": torch.get_num_threads(),
                },
            )
        )
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    sent_prompt_logprobs: dict[str, int] = {}  # request id -> prompt logprob entries already sent
    try:
        while True:
            while conn.poll(0) or not engine.has_unfinished_requests():  # idle: wait for a message
                kind, *args = conn.recv()
                if kind == "shutdown":
                    return
                _handle(engine, kind, args)
                if (
                    kind != "add" and not engine.has_unfinished_requests()
                ):  # nothing to step: say what changed
                    conn.send(("stats", server_stats(engine)))
            outputs = engine.step()
            rec = (
                engine.trace.steps[-1]
                if engine.config.record_trace and engine.trace.steps
                else None
            )
            rows = len(rec.rows) if rec else 0
            preempted = len(rec.preempted) + len(rec.swapped_out) if rec else 0
            conn.send(
                (
                    "step",
                    (
                        _deltas(outputs),
                        _new_prompt_logprobs(outputs, sent_prompt_logprobs),
                        server_stats(engine),
                        rows,
                        preempted,
                    ),
                )
            )
    except (EOFError, BrokenPipeError, OSError):  # the API process is gone
        return
    except Exception as e:  # a bug in the loop: tell the API process, which fails what is in flight
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        engine.shutdown()  # the tensor-parallel workers, if any


def _handle(engine, kind: str, args) -> None:
    if kind == "add":
        (samples,) = args
        try:
            engine.add_samples(samples)
        except ValueError:  # the API process checked it with the same config: not expected
            pass
    elif kind == "abort":
        engine.abort_request(args[0])
    elif kind == "stop":  # one sample's text reached a stop string in the API process
        engine.scheduler.abort_request(args[0], RequestStatus.FINISHED_STOPPED)


def _deltas(outputs: list[RequestOutput]) -> list[tuple]:
    """(sample id, new token ids, finish reason or None, stop reason, error, their logprob entries,
    time)."""
    now, deltas = time.perf_counter(), []
    for out in outputs:
        for sample in out.outputs:
            if sample.new_token_ids or sample.finish_reason:
                sid = out.request_id if sample.index == 0 else f"{sample.index}_{out.request_id}"
                entries = (
                    sample.logprobs[-len(sample.new_token_ids) :]
                    if sample.logprobs and sample.new_token_ids
                    else None
                )
                deltas.append(
                    (
                        sid,
                        sample.new_token_ids,
                        sample.finish_reason,
                        sample.stop_reason,
                        out.error if sample.finish_reason == "error" else None,
                        entries,
                        now,
                    )
                )
    return deltas


def _new_prompt_logprobs(outputs: list[RequestOutput], sent: dict[str, int]) -> dict[str, list]:
    found = {}
    for out in outputs:
        if out.prompt_logprobs is not None:
            start = sent.get(out.request_id, 1)  # entry 0 is None on both sides
            if len(out.prompt_logprobs) > start:
                found[out.request_id] = out.prompt_logprobs[start:]
                sent[out.request_id] = len(out.prompt_logprobs)
        if out.finished:
            sent.pop(out.request_id, None)
    return found

"""StepExecutor: launches the model runner's steps, one after another, and hands back futures (vLLM
V1's `execute_model(scheduler_output, non_block=True)`), so that the engine's thread schedules the
next step and processes the last one's outputs meanwhile.

Where a step is launched: on CUDA, on the engine's own thread (`inline`, vLLM V1's way): a launch
only queues kernels and the copies of the inputs, so it returns while the device works. On a CPU
the forward pass is the device's work itself, so it runs on a thread of its own, the device thread;
so does, on CUDA too, a step whose sampling must wait for the step before's processing (below).

The device thread plays the GPU's stream. Steps run on it in the order they were launched, so the
K/V that step N writes is in the cache when step N+1 reads it, and blocks freed when N's outputs are
processed are reused only by steps launched later. On a CPU the overlap is real because torch
releases the GIL inside its operators: while that thread runs a layer's matmuls, the engine's
thread runs Python.

Three hand-offs keep an async step exact and the device busy:
  - its placeholder tokens (PLACEHOLDER_TOKEN_ID: tokens the step before was still sampling when
    this one was scheduled) are written into its input ids from the step before's sampled-token
    tensor, on the device (fill_placeholders; vLLM V1's prev_sampled_token_ids), so the step is
    launched without waiting for those tokens to reach the host;
  - the sampled tokens' copy to the host is started, not waited for (AsyncModelRunnerOutput: on
    CUDA a non-blocking copy into pinned memory and an event); an output thread waits for it and
    resolves the step's future (vLLM V1's async output copy), while the device thread launches the
    next step (on a CPU the tokens are on the host already: the device thread resolves it);
  - a step's sampling waits until the step before has been processed (`wait_before_sampling`):
    sampling reads what processing writes (a grammar advanced by the last token, the output tokens
    that penalties count, the samples a request forked into).

One trap on a CPU: OpenMP. The thread that loaded the model and sized the cache ran torch's
parallel operators, so it owns a team of OpenMP worker threads, and the device thread gets a team of
its own. GNU OpenMP (libgomp, which torch's CPU wheels ship) counts the threads of every team; once
they outnumber the cores, its workers stop spinning between two parallel regions and sleep in the
kernel instead, so every matmul of the forward pass first waits for a worker to be woken. On 2
cores that cost the device thread's forward passes about 10% (about 180 sleeps per forward pass of
a 30-layer toy, and 630 per W1 step, against 3 per step with one team). So the engine's thread hands
its own team back once the device thread takes over (release_openmp_threads).
"""

import ctypes
import time
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Event

import torch

from ..core.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from ..model_executor.attention import to_device
from ..trace import StepTimes
from .model_runner import HostInputs, ModelRunner, ModelRunnerOutput


def fill_placeholders(out: SchedulerOutput, h: HostInputs, prev, device):
    """The input tokens that were placeholders when the step was scheduled, from the step before's
    sampled tokens on the device (vLLM V1: prev_sampled_token_ids). `prev`: (that step's sampled
    tokens as a tensor, {sequence id: index in it}), the runner's `last_sampled`. Returns (positions
    in input_ids, their tokens) as device tensors for ModelRunner.execute(fill=...), or None. A
    placeholder of a request missing from `prev` (its step or its sampling failed, so it fails too)
    is fed token 0."""
    ids, index = h.input_ids, {} if prev is None else prev[1]
    found = [j for j, token in enumerate(ids) if token == PLACEHOLDER_TOKEN_ID]
    positions, sources = [], []
    rows, starts, row = out.scheduled, h.row_starts, 0
    for j in found:  # in order, so the row that holds each is found walking forward
        while row + 1 < len(starts) and starts[row + 1] <= j:
            row += 1
        ids[j] = 0  # a valid id until the device writes the sampled one
        i = index.get(rows[row].request.request_id)
        if i is not None:
            positions.append(j)
            sources.append(i)
    if not positions:
        return None
    # positions and sources in one copy to the device
    both = to_device(positions + sources, device)
    return both[: len(positions)], prev[0].index_select(0, both[len(positions) :])


def release_openmp_threads() -> bool:
    """Stop the calling thread's OpenMP worker threads (OpenMP 5's omp_pause_resource_all with
    omp_pause_hard, which libgomp implements for the calling thread's team), so that the teams left
    fit the cores. A later parallel operator on this thread makes a new team. True if released;
    False where torch's threads are not libgomp's (nothing to do)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    try:  # the libgomp this process loaded (torch's): dlopen hands back the same library
        with open("/proc/self/maps") as f:
            loaded = [line.split()[-1] for line in f if "/libgomp" in line]
        pause = ctypes.CDLL(loaded[0]).omp_pause_resource_all
    except (OSError, IndexError, AttributeError):  # not Linux, or another OpenMP runtime
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(2) == 0  # omp_pause_hard


class AsyncModelRunnerOutput:
    """A step's output whose sampled tokens are still on their way to the host (vLLM V1's
    AsyncGPUModelRunnerOutput): made on the device thread right after sampling, which starts the
    copy (on CUDA into pinned memory, non-blocking, then an event), and finished on the output
    thread, which waits for that copy only, not for the steps launched after it."""

    def __init__(self, result: ModelRunnerOutput):
        self.result, tokens, self.copied = result, result.pending_tokens, None
        if tokens is not None and tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
            tokens = host
        self.tokens = tokens

    def get_output(self) -> ModelRunnerOutput:
        if self.tokens is not None:
            if self.copied is not None:
                self.copied.synchronize()
            self.result.sampled_token_ids += self.tokens.tolist()
            self.result.pending_tokens = self.tokens = None
        return self.result


class StepExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.device = ThreadPoolExecutor(1, thread_name_prefix="minicb-device")
        self.output = ThreadPoolExecutor(1, thread_name_prefix="minicb-output")
        self.num_placeholders = 0  # input tokens fed from the step before's sampled tokens
        # On the H100 (figures/gpu_h100_2026-11-27.jsonl, calls 5-7) a batch-256 decode step took
        # 3.4-4.8 ms to launch on the engine's thread and 6-10 ms on the device thread, whose Python
        # takes turns on the GIL with the engine's; the device's idle share between steps moved
        # with the host more than with this choice (inline 13-44%, thread 14-36%).
        self.inline = runner.device.type == "cuda" and runner.tp is None
        self.threaded = None  # the device thread's last job, which an inline launch must follow
        self.num_inline = 0  # steps launched on the caller's thread
        # the forward passes run on the device thread from now on (module docstring: OpenMP)
        self.released_openmp = runner.device.type == "cpu" and release_openmp_threads()

    def execute_model(
        self,
        out: SchedulerOutput,
        h: HostInputs | None,
        times: StepTimes,
        wait_before_sampling: Event | None = None,
    ) -> "Future[tuple[ModelRunnerOutput, int | None, int | None]]":
        """Launch one step; its future gives (result, graph bucket, graph width) once its sampled
        tokens are on the host."""
        done = Future()
        if self.inline and wait_before_sampling is None:
            if self.threaded is not None:  # steps launch in order: the thread's comes first
                self.threaded.result()
                self.threaded = None
            self.num_inline += 1
            self._run(out, h, times, None, done)
        else:
            self.threaded = self.device.submit(self._run, out, h, times, wait_before_sampling, done)
        return done

    def _run(self, out, h, times: StepTimes, wait: Event | None, done: Future) -> None:
        times.device_start = time.perf_counter()
        fill = None
        if h is not None:
            fill = fill_placeholders(out, h, self.runner.last_sampled, self.runner.device)
            self.num_placeholders += 0 if fill is None else len(fill[0])

        def before_sampling():
            times.forward_end = time.perf_counter()
            if wait is not None:
                wait.wait()
            times.sample_start = time.perf_counter()

        try:
            result = self.runner.execute(out, h, before_sampling, defer=True, fill=fill)
        except Exception as e:  # its forward pass failed: the engine fails its requests
            times.device_end = time.perf_counter()
            done.set_exception(e)
            return
        graph = self.runner.last_graph_bucket, self.runner.last_graph_width
        pending = AsyncModelRunnerOutput(result)
        times.queued = time.perf_counter()
        if pending.copied is None:  # the tokens are on the host already (a CPU): no thread hop
            self._finish(pending, graph, times, done)
        else:
            self.output.submit(self._finish, pending, graph, times, done)

    def _finish(self, pending: AsyncModelRunnerOutput, graph, times: StepTimes, done: Future):
        """On the output thread: wait for the sampled tokens' copy to the host, then resolve."""
        try:
            result = pending.get_output()
        except Exception as e:
            done.set_exception(e)
            return
        finally:
            times.device_end = time.perf_counter()
        done.set_result((result, *graph))

    def shutdown(self) -> None:
        """Stop both threads once the steps they run are done."""
        self.device.shutdown(wait=True)
        self.output.shutdown(wait=True)

"""What one request or one failure may cost the server (issue 37), on the engine's side: a dead
engine core is reported everywhere and once, the core's trace is bounded, a client that stops
reading loses its slots, and a request's long lists (stop ids, logit_bias, stop strings) cost the
same per token as short ones while giving exactly the same tokens and text.

The AsyncEngine is driven by an asyncio loop of the test's own (no HTTP server); every wait is for
an event, bounded in time."""

import asyncio
import os
import random
import time

import pytest
import torch
from serving import one_torch_thread  # noqa: F401

from minicb import LLM, Engine, EngineConfig, SamplingParams
from minicb.engine.detokenizer import IncrementalDetokenizer
from minicb.model_executor.loader import load_model, make_tiny_model, save_tiny_model
from minicb.serve.engine_core import RemoteEngine
from minicb.serve.engine_loop import AsyncEngine
from minicb.serve.request_stream import RequestStream, StreamStalledError

MAX_LEN = 2048  # long enough that a request outlives what the test does to it
LONG = SamplingParams(max_tokens=MAX_LEN - 3, temperature=0, ignore_eos=True)
ABORTED = "vllm:request_success_total"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("bounds"), seed=8, max_position_embeddings=MAX_LEN
    )


def config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), dtype="float64", block_size=4, num_blocks=1024, max_num_seqs=8
    )


async def until(condition, timeout_s=60.0) -> None:
    """Wait (in the event loop, so that outputs keep arriving) until condition() holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def cpu_seconds(thread) -> float:
    """CPU time a thread of this process has used (Linux: /proc/self/task/<id>/stat)."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# ---------------------------------------------------------------------- a dead core
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads a thread's CPU time")
def test_a_killed_core_is_reported_everywhere_once(model_dir):
    calls = []

    async def main():
        remote = RemoteEngine(config(model_dir), core_threads=1)
        async_engine = AsyncEngine(remote, on_fatal=calls.append)
        async_engine.start(asyncio.get_running_loop())
        try:
            stream = await async_engine.submit([[4, 5, 6]], LONG)
            outputs = stream.__aiter__()
            await asyncio.wait_for(outputs.__anext__(), 60)  # running: it has a token
            assert async_engine.metrics.value("vllm:num_requests_running") == 1
            remote.process.kill()
            with pytest.raises(RuntimeError, match=r"engine core process died \(exit code -9\)"):
                while True:  # the outputs already on their way, then the error
                    await asyncio.wait_for(outputs.__anext__(), 60)
            await until(lambda: calls)
            assert async_engine.fatal_error == "the engine core process died (exit code -9)"
            assert not async_engine.is_running
            m = async_engine.metrics
            # not the last state it saw ("1 running"): nothing runs, and a scraper reads "dead"
            assert m.value("minicb:engine_alive") == 0
            assert m.value("vllm:num_requests_running") == m.value("minicb:kv_blocks_used") == 0
            assert m.value("vllm:num_requests_waiting") == 0
            with pytest.raises(RuntimeError, match=r"exit code -9"):  # new requests: refused
                await async_engine.submit([[7]], SamplingParams(max_tokens=2))
            # The loop waits on its inbox now, it does not spin: about no CPU in a second.
            used = cpu_seconds(async_engine._thread)
            await asyncio.sleep(1.0)
            assert cpu_seconds(async_engine._thread) - used < 0.3
        finally:
            async_engine.stop()

    asyncio.run(main())
    assert calls == ["the engine core process died (exit code -9)"]  # once, with the reason


# ---------------------------------------------------------------------- the core's trace
def test_the_cores_trace_is_bounded_and_an_idle_core_that_dies_is_noticed(model_dir):
    calls = []

    async def main():
        remote = RemoteEngine(config(model_dir), core_threads=1, trace_steps=5)
        async_engine = AsyncEngine(remote, on_fatal=calls.append)
        async_engine.start(asyncio.get_running_loop())
        try:
            params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
            stream = await async_engine.submit([[4, 5, 6]], params)
            async for outputs in stream:
                pass
            assert outputs[0].finished and len(outputs[0].outputs[0].token_ids) == 30
            # 30 steps ran in the core; its trace keeps the newest 5 (the stats say so)
            await until(lambda: remote.stats["num_trace_records"] == 5)
            assert async_engine.metrics.value("minicb:trace_records") == 5
            # Nothing in flight: the core's death is noticed all the same, by the closed pipe.
            remote.process.kill()
            await until(lambda: async_engine.fatal_error is not None)
            assert "the engine core process died" in async_engine.fatal_error
        finally:
            async_engine.stop()

    asyncio.run(main())
    assert len(calls) == 1


# ---------------------------------------------------------------------- a client that stops reading
def test_a_stream_nobody_reads_is_aborted_and_holds_one_output_per_request(model_dir):
    async def main():
        engine = Engine(config(model_dir))
        async_engine = AsyncEngine(engine, stall_timeout_s=0.3)
        async_engine.start(asyncio.get_running_loop())
        try:
            stream = await async_engine.submit([[4, 5, 6], [7, 8]], LONG)  # never iterated
            m = async_engine.metrics
            await until(lambda: m.value(ABORTED, finished_reason="abort") == 2)
            await until(lambda: not engine.has_unfinished_requests())
            assert m.value("vllm:num_requests_running") == m.value("minicb:kv_blocks_used") == 0
            # Hundreds of steps were handed to it: it keeps the newest output of each request.
            assert stream.num_waiting <= 2
            with pytest.raises(StreamStalledError, match="stall_timeout_s"):
                async for _ in stream:
                    pass
        finally:
            async_engine.stop()

    asyncio.run(main())


def test_stalled_counts_only_the_time_outputs_wait_for_a_consumer_that_takes_none():
    stream = RequestStream("s", 1, abort=lambda ids: None)
    timeout = 1.0
    stream.taken_at = None  # the consumer waits for outputs: whatever comes is taken
    assert not stream.stalled(100.0, timeout)
    assert not stream.stalled(200.0, timeout)
    stream.taken_at = 200.5  # it took them, and is busy (writing to its client)
    assert not stream.stalled(201.0, timeout)  # caught up: outputs wait from 201.0
    assert not stream.stalled(201.9, timeout)
    assert stream.stalled(202.5, timeout)  # 1.5 s without taking anything
    stream.taken_at = 202.6  # it read again
    assert not stream.stalled(203.0, timeout)


def test_a_consumer_that_never_started_waits_from_the_first_output():
    stream = RequestStream("s", 1, abort=lambda ids: None)  # made now, never iterated
    later = stream.received_at + 100.0  # a long prefill: the first output comes much later
    assert not stream.stalled(later, 1.0)
    assert stream.stalled(later + 1.5, 1.0)


def test_aborting_a_stream_ends_an_iteration_that_waits_and_aborts_once():
    # The server's watcher of a client's disconnect aborts the stream; the handler's iteration,
    # waiting for the next output, must end then, not at the next output (there may be none for
    # long), and the engine must be told once.
    aborted = []

    async def main():
        stream = RequestStream("s", 2, abort=aborted.append)
        got = []

        async def consume():
            async for outputs in stream:
                got.append(outputs)

        consumer = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)  # it waits for outputs
        assert not consumer.done()
        stream.abort()
        await asyncio.wait_for(consumer, 5)
        return got

    assert asyncio.run(main()) == []
    assert aborted == [["s-0", "s-1"]]


# ---------------------------------------------------------------------- long lists, same tokens
def reference_greedy(hf, prompt, p: SamplingParams, eos=1) -> list[int]:
    """Greedy decoding on transformers' logits with min_tokens, stop ids and logit_bias applied one
    entry at a time, in vLLM's order."""
    tokens, stop = list(prompt), {eos, *(p.stop_token_ids or ())}
    with torch.no_grad():
        while len(tokens) - len(prompt) < p.max_tokens:
            logits = hf(torch.tensor([tokens])).logits[0, -1].tolist()
            if len(tokens) - len(prompt) < p.min_tokens:
                for t in stop:
                    if t < len(logits):
                        logits[t] = float("-inf")
            for t, b in (p.logit_bias or {}).items():
                logits[t] += b
            tokens.append(max(range(len(logits)), key=lambda t: (logits[t], -t)))
            if tokens[-1] in stop:
                break
    return tokens[len(prompt) :]


def test_thousands_of_stop_ids_and_a_bias_on_every_token_give_the_reference_tokens(tmp_path):
    rng = random.Random(3)
    path = save_tiny_model(tmp_path, seed=9)
    hf = make_tiny_model(seed=9)
    llm = LLM.from_loaded(load_model(path, dtype=torch.float64), block_size=4, num_blocks=128)
    vocab = hf.config.vocab_size
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    params = [
        SamplingParams(  # 4,000 stop ids, most beyond the vocabulary; EOS held back for 6 tokens
            max_tokens=24, temperature=0, min_tokens=6, stop_token_ids=range(3, 12003, 3)
        ),
        SamplingParams(  # a bias on every token of the vocabulary
            max_tokens=24, temperature=0, logit_bias={t: rng.uniform(-3, 3) for t in range(vocab)}
        ),
    ]
    for p in params:
        got = llm.generate(prompts, p, use_tqdm=False)
        for prompt, out in zip(prompts, got):
            assert out.outputs[0].token_ids == reference_greedy(hf, prompt, p)


class Pieces:
    """A tokenizer whose tokens decode to fixed pieces of text, so that stop strings span tokens."""

    PIECES = ["a", "b", "ab", "ba", "aab", "bba", " ", "a b"]

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(self.PIECES[i] for i in ids)


def find_by_scanning(pieces, stop, min_tokens, include_stop):
    """The rule written out: after each token past min_tokens, every stop string is searched for
    with str.find from the last len(longest) - 1 characters before the new text; the earliest
    (then the smallest) is cut. Returns (token index where found, stop string, text)."""
    text, hold_back = "", max(map(len, stop)) - 1
    for k, piece in enumerate(pieces):
        new_from, text = len(text), text + piece
        if k + 1 > min_tokens:
            start = max(0, new_from - hold_back)
            found = [(i, s) for s in stop if (i := text.find(s, start)) >= 0]
            if found:
                i, s = min(found)
                return k, s, text[: i + len(s) if include_stop else i]
    return None, None, text


def test_stop_strings_found_by_length_sets_are_those_a_full_scan_finds():
    rng = random.Random(0)
    tokenizer = Pieces()
    for _ in range(2000):
        ids = [rng.randrange(len(Pieces.PIECES)) for _ in range(rng.randrange(1, 16))]
        stop = tuple({"".join(rng.choices("ab ", k=rng.randint(1, 5))) for _ in range(4)})
        min_tokens = rng.choice([0, 0, 2, 5])
        include_stop = rng.random() < 0.5
        detok = IncrementalDetokenizer(tokenizer, stop, include_stop, min_tokens=min_tokens)
        found_at = None
        for k, token in enumerate(ids):
            detok.add([token])
            if detok.stop_reason is not None:
                found_at = k
                break
        pieces = [Pieces.PIECES[i] for i in ids]
        want = find_by_scanning(pieces, stop, min_tokens, include_stop)
        assert (found_at, detok.stop_reason, detok.text) == want, (ids, stop, min_tokens)

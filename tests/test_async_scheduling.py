"""Async scheduling (vLLM V1's `async_scheduling`): step N+1 is scheduled and launched before step
N's sampled tokens reach the engine's thread, fed from them by the executor, and step N's outputs
are processed while N+1 runs. Everything a request gets must be what synchronous steps give it:
float64 tiny models, the same tokens, samples, logprobs and texts. (test_parity.py runs the
transformers parity configurations with it too.)"""

import asyncio
import json
import os

import httpx
import pytest
import torch
from reference import byte_model
from serving import serve

from minicb import Engine, EngineConfig, SamplingParams
from minicb.core.scheduler_output import PLACEHOLDER_TOKEN_ID
from minicb.worker.executor import fill_placeholders
from minicb.worker.model_runner import host_inputs

PROMPTS = [f"request {i}: " + "abcdefgh"[: i % 8] * (1 + i % 5) for i in range(10)]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return byte_model(tmp_path_factory.mktemp("bytes"))


def engine(loaded, **config) -> Engine:
    base = dict(model=loaded.name, dtype="float64", block_size=4, num_blocks=256, max_num_seqs=6)
    return Engine(EngineConfig(**base | {"max_num_batched_tokens": 24} | config), loaded)


def run(eng: Engine, requests, check_books: bool = True) -> list:
    """Add (prompt, params) pairs, step to the end checking the block manager's books; the finished
    outputs in order."""
    ids = [eng.add_request(p, params) for p, params in requests]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id not in done, f"{o.request_id} got an output after it finished"
            if o.finished:
                done[o.request_id] = o
        if check_books:
            eng.scheduler.block_manager.check_invariants()
    assert eng.scheduler.block_manager.num_used_blocks == 0, "blocks leaked"
    return [done[i] for i in ids]


def rounded(logprobs) -> list | None:
    """Logprobs to 1e-9: float64 sums in another batch round differently in the last bits."""
    if logprobs is None:
        return None
    return [{t: (round(lp.logprob, 9), lp.rank) for t, lp in step.items()} for step in logprobs]


def summary(outputs) -> list:
    """What a user sees of each output: per sample, tokens, text, finish reason, logprobs."""
    return [
        [
            (c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, rounded(c.logprobs))
            for c in o.outputs
        ]
        for o in outputs
    ]


def mixed_requests() -> list:
    """Greedy and seeded, n > 1, stop strings, penalties, logprobs, a JSON constraint."""
    p = SamplingParams
    kinds = [
        p(max_tokens=17, temperature=0),
        p(max_tokens=12, temperature=1.0, seed=3),
        p(n=3, max_tokens=9, temperature=0.9, seed=11),
        p(max_tokens=30, temperature=1.0, seed=7, stop=["a", "e"]),
        p(max_tokens=14, temperature=0.8, seed=2, repetition_penalty=1.3, frequency_penalty=0.5),
        p(max_tokens=10, temperature=1.0, seed=4, logprobs=3),
        p(max_tokens=24, temperature=1.0, seed=9, structured_outputs={"json": SCHEMA}),
        p(max_tokens=8, temperature=0, min_tokens=6),
        p(n=2, max_tokens=6, temperature=0),
        p(max_tokens=20, temperature=1.0, seed=1, stop=["b"], include_stop_str_in_output=True),
    ]
    return list(zip(PROMPTS, kinds))


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"num_blocks": 40, "preemption_mode": "recompute"},
        {"num_blocks": 40, "preemption_mode": "swap"},
        {"num_blocks": 48, "scheduling_policy": "priority"},
        {"max_num_batched_tokens": 5},
        {"use_cuda_graph": True},  # emulated on a CPU: the placeholders written into its buffers
    ],
    ids=["roomy", "recompute", "swap", "priority", "tiny_budget", "graphs"],
)
@pytest.mark.parametrize("launch", ["thread", "inline"])
def test_async_gives_what_sync_gives(loaded, config, launch):
    """`launch`: steps launched on the device thread (a CPU's way), or on the engine's own thread
    as on CUDA, where steps whose sampling waits for processing still take the device thread: the
    mixed requests give both kinds, so the two paths must keep the steps in order."""
    sync = run(engine(loaded, **config), mixed_requests())
    eng = engine(loaded, async_scheduling=True, **config)
    executor = eng.batch_queue.executor
    executor.inline = launch == "inline"
    got = run(eng, mixed_requests())
    assert summary(got) == summary(sync)
    fed = executor.num_placeholders
    assert fed > 0, "no step was fed a token from the step before"
    if executor.inline:
        assert 0 < executor.num_inline < len(eng.trace), "not both ways: the test did not test it"
    if config.get("use_cuda_graph"):
        assert any(s.graph_bucket for s in eng.trace), "no step replayed a graph"
    if config.get("num_blocks", 256) <= 40:
        assert any(s.preempted or s.swapped_out for s in eng.trace), "nothing was preempted"
    eng.shutdown()


def test_a_finished_request_extra_row_leaks_no_token_and_no_block(loaded):
    """A request that stops at step N was already scheduled for step N+1 (its token was not known).
    That row runs, its token is dropped, its blocks are freed once."""
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (free_run,) = run(engine(loaded), [(PROMPTS[3], greedy)])
    tokens = free_run.outputs[0].token_ids
    stop_at = 4  # its 5th token becomes a stop token: it finishes in the step that samples it
    params = SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[tokens[stop_at]]
    )
    eng = engine(loaded, async_scheduling=True)
    (out,) = run(eng, [(PROMPTS[3], params)])
    first = tokens.index(tokens[stop_at])  # the stop token may come earlier
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    rid = out.request_id
    rows = [(s.step, r) for s in eng.trace for r in s.rows if r.request_id == rid]
    finish_steps = [s.step for s in eng.trace if rid in s.finished]
    assert len(finish_steps) == 1, "finished (and freed) more than once"
    extra = [step for step, r in rows if step > finish_steps[0]]
    assert extra == [finish_steps[0] + 1], "no extra row ran: the test did not test it"
    assert eng.scheduler.block_manager.num_free_blocks == eng.config.num_blocks
    eng.shutdown()


def test_abort_while_a_step_is_in_flight(loaded):
    eng = engine(loaded, async_scheduling=True)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    a, b = eng.add_request(PROMPTS[1], params), eng.add_request(PROMPTS[2], params)
    for _ in range(4):
        eng.step()
    assert eng.batch_queue.in_flight is not None
    last = eng.abort_request(a)
    assert last.finished and last.outputs[0].finish_reason == "abort"
    seen = len(last.outputs[0].token_ids)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    # step() reports an abort once more (as with synchronous steps), with no token added
    late = [o.outputs[0].token_ids for o in outs if o.request_id == a]
    assert all(len(t) == seen for t in late), "the aborted request got a token after its abort"
    (done,) = [o for o in outs if o.finished and o.request_id == b]
    assert len(done.outputs[0].token_ids) == 30 and seen < 30
    eng.scheduler.block_manager.check_invariants()
    assert eng.scheduler.block_manager.num_used_blocks == 0
    eng.shutdown()


@pytest.mark.parametrize("penalty", [1.0, 1.3], ids=["plain", "repetition_penalty"])
def test_the_steps_overlap_in_the_trace(loaded, penalty):
    """The pipeline's order, read from each step's times: step N+1 is launched before step N's
    outputs are processed. A step whose sampling reads what that processing writes (here the output
    tokens a repetition penalty counts) samples only after it; plain greedy steps need not wait, and
    whether they do is a race the test leaves alone."""
    eng = engine(loaded, async_scheduling=True)
    params = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=penalty
    )
    run(eng, [(p, params) for p in PROMPTS])
    steps = [s for s in eng.trace if s.rows]
    pairs = list(zip(steps, steps[1:]))
    assert len(pairs) > 5
    for before, after in pairs:
        assert after.times.launch <= before.times.outputs_start
        if penalty != 1.0 and any(r.sampled for r in after.rows):
            assert after.times.sample_start >= before.times.outputs_end
        # one device, in order: a step's forward pass starts once the step before has sampled (it
        # need not wait for those tokens to reach the host)
        assert after.times.device_start >= before.times.sample_start
    eng.shutdown()


def test_placeholders_are_filled_from_the_step_before(loaded):
    eng = engine(loaded, async_scheduling=True)
    eng.add_request("hi", SamplingParams(max_tokens=5, temperature=0))
    eng.step()  # the prompt, in flight
    out = eng.scheduler.schedule()  # its first decode, scheduled before the prompt's token landed
    (row,) = out.scheduled
    assert row.token_ids == [PLACEHOLDER_TOKEN_ID] and not row.is_prefill
    h = host_inputs(out, eng.config.block_size)
    rid = row.request.request_id
    prev = (torch.tensor([7, 42, 9]), {"other": 0, rid: 1})  # the step before's sampled tokens
    positions, tokens = fill_placeholders(out, h, prev, eng.runner.device)
    assert positions.tolist() == [0] and tokens.tolist() == [42] and h.input_ids == [0]
    eng.shutdown()


def test_fill_placeholders_finds_each_rows_token_in_the_step_before():
    """Rows of several tokens around placeholder ones: each placeholder takes its own request's
    token from the step before's; one whose request is missing there (its sampling failed) is fed
    0 and left out; tokens that are not placeholders stay."""
    from types import SimpleNamespace as NS

    P = PLACEHOLDER_TOKEN_ID
    rows = [NS(request=NS(request_id=r), num_tokens=n) for r, n in (("a", 1), ("b", 3), ("c", 1))]
    rows += [NS(request=NS(request_id="d"), num_tokens=2)]
    h = NS(input_ids=[P, 5, 6, 8, P, 4, P], row_starts=[0, 1, 4, 5])
    prev = (torch.tensor([70, 71, 72]), {"b": 0, "a": 2, "d": 1})  # "c" failed
    positions, tokens = fill_placeholders(NS(scheduled=rows), h, prev, "cpu")
    assert positions.tolist() == [0, 6] and tokens.tolist() == [72, 71]
    assert h.input_ids == [0, 5, 6, 8, 0, 4, 0]
    assert (
        fill_placeholders(
            NS(scheduled=rows), NS(input_ids=[1] * 7, row_starts=[0, 1, 4, 5]), prev, "cpu"
        )
        is None
    )


def voluntary_switches() -> int:
    """Times this process's live threads slept in the kernel (Linux)."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/status") as f:
                total += sum(
                    int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt")
                )
        except OSError:  # it exited meanwhile
            pass
    return total


@pytest.mark.skipif(
    "OpenMP" not in torch.__config__.parallel_info()
    or not os.path.isdir("/proc/self/task")
    or os.cpu_count() < 2,
    reason="torch's threads are OpenMP's in Linux wheels, and one core makes no team",
)
def test_the_engines_thread_hands_its_openmp_team_back():
    """executor.py: once a second thread runs parallel operators, libgomp counts two teams; more
    threads than cores, its workers sleep between parallel regions instead of spinning. After
    release_openmp_threads on the thread that ran them first, the device thread's regions sleep
    far less often (counted, not timed)."""
    from concurrent.futures import ThreadPoolExecutor

    from minicb.worker.executor import release_openmp_threads

    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count())
    x = torch.ones(1 << 20)

    def regions():  # 300 parallel regions (an elementwise op over 1M elements each)
        torch.set_num_threads(os.cpu_count())  # per thread: OMP_NUM_THREADS may say otherwise
        for _ in range(300):
            torch.add(x, 1.0)

    def sleeps_on_a_new_thread() -> int:
        with ThreadPoolExecutor(1) as device:
            device.submit(regions).result()  # its team made, warm
            start = voluntary_switches()
            device.submit(regions).result()
            return voluntary_switches() - start  # (its team ends with the thread)

    try:
        regions()  # this thread's own team
        two_teams = sleeps_on_a_new_thread()
        assert release_openmp_threads()
        one_team = sleeps_on_a_new_thread()
    finally:
        torch.set_num_threads(before)
    assert two_teams >= 100 and one_team < two_teams / 4, (two_teams, one_team)


def test_an_in_process_server_hands_the_builders_openmp_team_back(loaded, monkeypatch):
    """`serve --engine-in-process` builds the engine on its main thread and steps it on the engine
    loop's: AsyncEngine.start (on the main thread) releases the builder's team first."""
    import threading

    import minicb.worker.executor as executor
    from minicb.serve.engine_loop import AsyncEngine

    calls = []
    monkeypatch.setattr(
        executor, "release_openmp_threads", lambda: calls.append(threading.get_ident())
    )
    server = AsyncEngine(engine(loaded))
    loop = asyncio.new_event_loop()
    try:
        server.start(loop)
    finally:
        server.stop()
        loop.close()
    assert calls == [threading.get_ident()]


def test_drafts_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="async_scheduling=True does not work with speculative"):
        EngineConfig(
            num_blocks=8,
            async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        EngineConfig(num_blocks=8, async_scheduling="yes")


def test_a_server_with_async_scheduling_streams_the_same_tokens(loaded):
    """Over HTTP: concurrent completions (half of them streamed) through an engine with async
    scheduling give the offline engine's tokens, and the server ends idle with no block held."""
    prompts = [f"p{i} " + "xyz" * i for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in run(engine(loaded), [(p, params) for p in prompts])]

    async def one(client, prompt, stream):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        if not stream:
            return (await client.post("/v1/completions", json=body)).json()["choices"][0][
                "token_ids"
            ]
        ids = []
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0]["token_ids"]
        return ids

    async def all_at_once(url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            calls = [one(client, p, i % 2 == 0) for i, p in enumerate(prompts)]
            return await asyncio.wait_for(asyncio.gather(*calls), timeout=60)

    with serve(loaded, async_scheduling=True, block_size=4, num_blocks=256) as s:
        assert asyncio.run(all_at_once(s.url)) == expected
        s.wait_idle()
        assert s.engine.batch_queue.executor.num_placeholders > 0


def test_an_extra_row_write_is_never_a_prefix_hit(loaded):
    """A request that stops in step N has the K/V of its last token written by its extra row in
    N+1. Blocks are cached when a step is processed, up to the tokens that have landed, which that
    last token has not when N is processed and the request finishes: the block it would fill is not
    cached, as with synchronous steps, and a later request extending its text hits the same blocks
    and gets the same tokens."""
    prompt = [40 + i for i in range(9)]  # 9 tokens: blocks of 4
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (free_run,) = run(engine(loaded), [(prompt, greedy)])
    tokens = free_run.outputs[0].token_ids
    # stop at output m where prompt + m + 1 tokens fill whole blocks, on a token not seen before it
    m = next(m for m in range(len(tokens)) if (9 + m + 1) % 4 == 0 and tokens.index(tokens[m]) == m)
    stop = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[tokens[m]])
    longer = prompt + tokens[: m + 1] + [7, 8, 9]
    starts, outs = {}, {}
    for mode in (False, True):
        eng = engine(loaded, async_scheduling=mode, max_num_seqs=1)
        (a,) = run(eng, [(prompt, stop)])
        assert a.outputs[0].token_ids == tokens[: m + 1]
        (b,) = run(eng, [(longer, greedy)])
        outs[mode] = b.outputs[0].token_ids
        starts[mode] = next(r.start for s in eng.trace for r in s.rows if r.request_id == "1")
        eng.shutdown()
    assert outs[True] == outs[False]
    assert starts == {False: 9 + m + 1 - 4, True: 9 + m + 1 - 4}  # not the extra row's block

"""The OpenAI-compatible server, driven over real loopback HTTP (httpx, and the openai client).

Tiny random float64 models keep it fast and exact: every output is compared token for token with
`LLM.generate` on the same weights. One model has no tokenizer (prompts are token ids); a copy
gets a word-level tokenizer with a chat template so text prompts and /v1/chat/completions run too.
Every loop below is bounded in count and time.
"""

import asyncio
import itertools
import json
from types import SimpleNamespace

import httpx
import pytest
import torch
from reference import add_word_tokenizer
from serving import (
    CONFIG,
    MAX_LEN,
    NODELAY,
    Served,
    one_torch_thread,  # noqa: F401 (a fixture)
    reference,
    serve,
    sse_events,
)

from minicb import SamplingParams
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.serve.request_stream import RequestStream


@pytest.fixture(scope="module")
def plain(tmp_path_factory):  # no tokenizer
    return load_model(
        save_tiny_model(tmp_path_factory.mktemp("plain"), seed=5, max_position_embeddings=MAX_LEN),
        torch.float64,
    )


@pytest.fixture(scope="module")
def worded(tmp_path_factory):  # the same weights, with a tokenizer and a chat template
    path = save_tiny_model(
        tmp_path_factory.mktemp("worded"), seed=5, max_position_embeddings=MAX_LEN
    )
    return load_model(add_word_tokenizer(path), torch.float64)


@pytest.fixture(scope="module")
def server(plain):
    with serve(plain) as s:
        yield s


@pytest.fixture(scope="module")
def chat_server(worded):
    with serve(worded) as s:
        yield s


def stream_completion(s: Served, path: str, body: dict) -> list:
    with s.http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)


# ---------------------------------------------------------------------- the basics
def test_models_health_and_metrics(server):
    models = server.http.get("/v1/models").json()
    assert models["data"][0]["id"] == server.name and models["data"][0]["max_model_len"] == MAX_LEN
    assert server.http.get("/health").json() == {"status": "ok"}
    r = server.http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "minicb:num_requests_swapped",
        "minicb:kv_blocks_used",
        "minicb:kv_blocks_free",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "minicb:batch_size_bucket",
    ):
        assert f"{name}{{" in r.text
    # vLLM's label, the served name
    assert f'vllm:num_requests_running{{model_name="{server.name}"}} 0.0' in r.text
    assert server.metrics()["minicb:kv_blocks_free"] == CONFIG["num_blocks"]


def test_concurrent_requests_share_decode_steps(server, plain):
    prompts = [[3 + i, 40 + i, 7] * (1 + i % 3) for i in range(8)]
    lengths = [24 + 5 * i for i in range(8)]
    bodies = [
        {"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        for p, n in zip(prompts, lengths)
    ]
    expected = reference(
        plain,
        prompts,
        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths],
    )

    async def one(client, body, stream):
        if not stream:
            r = await client.post("/v1/completions", json=body)
            return r.json()["id"], r.json()["choices"][0]["token_ids"]
        ids, rid = [], None
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    rid, ids = chunk["id"], ids + chunk["choices"][0]["token_ids"]
        return rid, ids

    async def all_at_once():
        transport = httpx.AsyncHTTPTransport(socket_options=NODELAY)
        async with httpx.AsyncClient(
            base_url=server.url, timeout=30, transport=transport
        ) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, b, i % 2 == 0) for i, b in enumerate(bodies))),
                timeout=30,
            )

    before = server.metrics()
    results = asyncio.run(all_at_once())
    assert [ids for _, ids in results] == expected  # batching changes nothing
    # the engine request of prompt 0
    mine = {rid.removeprefix("cmpl-") + "-0" for rid, _ in results}
    shared = [
        step
        for step in server.engine.trace
        if sum(r.request_id in mine and not r.is_prefill for r in step.rows) >= 2
    ]
    assert shared, "no engine step decoded two of these HTTP requests together"
    after = server.wait_idle()
    # The batch-size histogram of /metrics saw steps with more than one request in them.
    more_than_one = lambda m: m["minicb:batch_size_count"] - m['minicb:batch_size_bucket{le="1.0"}']
    assert more_than_one(after) > more_than_one(before)
    assert (
        after['vllm:request_success_total{finished_reason="length"}']
        - before['vllm:request_success_total{finished_reason="length"}']
        == 8
    )


def test_streamed_equals_non_streamed_completions(server, plain):
    prompts = [[5, 6, 7], [9] * 13, [20, 21]]
    expected = reference(plain, prompts, SamplingParams(max_tokens=12, temperature=0))
    for prompt, want in zip(prompts, expected):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        whole = server.http.post("/v1/completions", json=body).json()
        assert whole["object"] == "text_completion" and whole["choices"][0]["token_ids"] == want
        assert whole["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(want),
            "total_tokens": len(prompt) + len(want),
        }
        chunks = stream_completion(
            server, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
        )
        *token_chunks, last = chunks
        assert [t for c in token_chunks for t in c["choices"][0]["token_ids"]] == want
        assert (
            token_chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
        )
        assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks[:-1])
        assert last["choices"] == [] and last["usage"] == whole["usage"]


def test_a_stream_interval_sends_n_new_tokens_a_chunk_and_loses_none(plain, worded):
    """vLLM's --stream-interval 4: the first token at once, then a chunk each 4 new tokens, and the
    last at the finish; the same tokens and text as every token streamed."""
    body = {"prompt": [5, 6, 7], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = reference(plain, [body["prompt"]], params)[0]
    with serve(plain, stream_interval=4) as s:
        chunks = stream_completion(s, "/v1/completions", body)
        ids = [c["choices"][0]["token_ids"] for c in chunks]
        assert [t for chunk in ids for t in chunk] == want
        # after each chunk, the tokens so far: 1, 5, 9, 10 (two may be coalesced for a client
        # that reads late, never more split)
        ends = set(itertools.accumulate(map(len, ids)))
        assert ends <= {1, 5, 9, 10} and len(ids) >= 2, ids
    with serve(worded, stream_interval=3) as s:
        text = {"prompt": "w40 w41 w42", "max_tokens": 9, "temperature": 0, "ignore_eos": True}
        whole = s.http.post("/v1/completions", json=text).json()["choices"][0]["text"]
        pieces = stream_completion(s, "/v1/completions", text)
        assert "".join(c["choices"][0]["text"] for c in pieces) == whole != ""
        assert len(pieces) <= 5  # 1, 4, 7, 9 tokens (and the usage-less end): not 9 chunks


def test_request_stream_due_every_n_tokens():
    """RequestStream.due, the rule on its own: a request's first output, its last, and one each
    time `interval` new tokens have come since the last handed (several at once: speculative
    decoding's accepted drafts)."""
    out = lambda rid, n, done=False: SimpleNamespace(
        request_id=rid, finished=done, outputs=[SimpleNamespace(token_ids=list(range(n)))]
    )
    stream = RequestStream("0", 2, abort=lambda ids: None, interval=3)
    got = [n for n in range(1, 9) if stream.due(out("0-0", n))]
    assert got == [1, 4, 7]
    assert stream.due(out("0-1", 1)) and not stream.due(out("0-1", 2))  # its own count
    assert stream.due(out("0-0", 8, done=True))  # the last, whatever the count
    assert stream.due(out("0-1", 6))  # 5 new at once (drafts accepted): due
    every = RequestStream("1", 1, abort=lambda ids: None)
    assert all(every.due(out("1-0", n)) for n in range(1, 5))


def test_streamed_equals_non_streamed_chat_and_text(chat_server, worded):
    s = chat_server
    messages = [
        {"role": "system", "content": "w9 w10"},
        {"role": "user", "content": "w30 w31 w32 w33"},
    ]
    body = {"messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    whole = s.http.post("/v1/chat/completions", json=body).json()
    message = whole["choices"][0]["message"]
    assert whole["object"] == "chat.completion" and message["role"] == "assistant"
    chat_ids = worded.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    want = reference(
        worded, [list(chat_ids)], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )[0]
    assert whole["choices"][0]["token_ids"] == want
    assert message["content"] == worded.tokenizer.decode(want, skip_special_tokens=True) != ""
    chunks = stream_completion(s, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == message["content"]
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # A text prompt on /v1/completions: streamed text pieces add up to the whole text.
    body = {"prompt": "w40 w41 w42", "max_tokens": 9, "temperature": 0}
    whole = s.http.post("/v1/completions", json=body).json()["choices"][0]
    pieces = stream_completion(s, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in pieces) == whole["text"]
    assert [t for c in pieces for t in c["choices"][0]["token_ids"]] == whole["token_ids"]


# ---------------------------------------------------------------------- bad input
LONG = {"max_tokens": MAX_LEN - 3}
BAD_COMPLETIONS = [  # (body, status, words in the message, param)
    (b'{"prompt": [1, 2', 400, "not valid JSON", None),
    (b"[1, 2]", 400, "must be a JSON object", None),
    ({"max_tokens": 4}, 400, "'prompt' is required", "prompt"),
    (
        {"prompt": 5},
        400,
        "'prompt' must be a non-empty string, a list of integer token ids",
        "prompt",
    ),
    ({"prompt": [3, "a"]}, 400, "'prompt' must be", "prompt"),
    ({"prompt": [3, True]}, 400, "'prompt' must be", "prompt"),
    ({"prompt": []}, 400, "'prompt' must be", "prompt"),
    (
        {"prompt": [[3], "w5"]},
        400,
        "'prompt' must be",
        "prompt",
    ),  # several prompts: all of one kind
    ({"prompt": [[3], []]}, 400, "'prompt' must be", "prompt"),
    (
        {"prompt": [[3], [3] * (MAX_LEN + 5)]},
        400,
        "prompt 1: prompt has 2053 tokens",
        "prompt",
    ),  # all or nothing
    ({"prompt": "some text"}, 400, "has no tokenizer", "prompt"),
    ({"prompt": [3, 500]}, 400, "token ids must be integers in [0, 128)", "prompt"),
    (
        {"prompt": [3], "max_tokens": "8"},
        400,
        "'max_tokens': Input should be a valid integer",
        "max_tokens",
    ),
    (
        {"prompt": [3], "max_tokens": 8.5},
        400,
        "'max_tokens': Input should be a valid integer",
        "max_tokens",
    ),
    (
        {"prompt": [3], "max_tokens": 0, "min_tokens": 1},
        400,
        "min_tokens must be at most max_tokens (0)",
        "min_tokens",
    ),
    ({"prompt": [3], "max_tokens": -5}, 400, "greater than or equal to 0", "max_tokens"),
    ({"prompt": [3], "max_tokens": 10**6}, 400, "exceeds max_model_len 2048", "max_tokens"),
    ({"prompt": [3] * (MAX_LEN + 5)}, 400, "exceeds max_model_len 2048", "prompt"),
    (
        {"prompt": [3], "temperature": -0.5},
        400,
        "'temperature': Input should be greater than or equal to 0",
        "temperature",
    ),
    (
        {"prompt": [3], "temperature": "hot"},
        400,
        "'temperature': Input should be a valid number",
        "temperature",
    ),
    ({"prompt": [3], "top_p": 0}, 400, "'top_p': Input should be greater than 0", "top_p"),
    (
        {"prompt": [3], "top_p": 1.5},
        400,
        "'top_p': Input should be less than or equal to 1",
        "top_p",
    ),
    (
        {"prompt": [3], "top_k": -2},
        400,
        "'top_k': Input should be greater than or equal to -1",
        "top_k",
    ),
    ({"prompt": [3], "top_k": 2.5}, 400, "'top_k': Input should be a valid integer", "top_k"),
    ({"prompt": [3], "seed": "x"}, 400, "'seed': Input should be a valid integer", "seed"),
    ({"prompt": [3], "stream": "yes"}, 400, "'stream': Input should be a valid boolean", "stream"),
    ({"prompt": [3], "n": 9}, 400, "n=9 samples x 1 prompt = 9 slots, but one request", "n"),
    ({"prompt": [3], "n": 129}, 400, "'n': Input should be less than or equal to 128", "n"),
    (
        {"prompt": [3], "presence_penalty": 2.5},
        400,
        "'presence_penalty': Input should be less than or equal to 2",
        "presence_penalty",
    ),
    (
        {"prompt": [3], "frequency_penalty": -3},
        400,
        "'frequency_penalty': Input should be greater than or equal to -2",
        "frequency_penalty",
    ),
    (
        {"prompt": [3], "repetition_penalty": 0},
        400,
        "'repetition_penalty': Input should be greater than or equal to 0.01",
        "repetition_penalty",
    ),
    (
        {"prompt": [3], "min_p": 1.5},
        400,
        "'min_p': Input should be less than or equal to 1",
        "min_p",
    ),
    (
        {"prompt": [3], "max_tokens": 4, "min_tokens": 5},
        400,
        "min_tokens must be an integer in [0, max_tokens=4]",
        "min_tokens",
    ),
    (
        {"prompt": [3], "logprobs": 21},
        400,
        "'logprobs': Input should be less than or equal to 20",
        "logprobs",
    ),
    (
        {"prompt": [3], "logprobs": True},
        400,
        "'logprobs': Input should be a valid integer",
        "logprobs",
    ),
    (
        {"prompt": [3], "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs is not available when streaming",
        "prompt_logprobs",
    ),
    (
        {"prompt": [3], "logit_bias": {"w5": 1}},
        400,
        "'logit_bias' keys must be token ids written as strings",
        "logit_bias",
    ),
    ({"prompt": [3], "logit_bias": {"5": 101}}, 400, "less than or equal to 100", "logit_bias"),
    (
        {"prompt": [3], "logit_bias": {"500": 1}},
        400,
        "logit_bias token ids must be in [0, 128)",
        None,
    ),
    (
        {"prompt": [3], "best_of": 2},
        400,
        "best_of is not supported by minicb (only null or the value of n",
        "best_of",
    ),
    ({"prompt": [3], "best_of": 0}, 400, "'best_of' is not supported by minicb", "best_of"),
    (
        {"prompt": [3], "suffix": "!"},
        400,
        "'suffix' is not supported by minicb (only null)",
        "suffix",
    ),
    ({"prompt": [3], "stop": ["\n"]}, 400, "stop strings are found in text", None),  # no tokenizer
    ({"prompt": [3], "stop": [""]}, 400, "'stop'", "stop"),
    ({"prompt": [3], "priority": 3}, 400, "scheduling_policy='priority'", None),
    ({"prompt": [3], "model": "gpt-4"}, 404, "is not served here", "model"),
    # The fuzzing report's findings (issue 21): each a clear 400, nothing reaches the engine.
    (
        {"prompt": [3], "max_tokens": 2, "top_k": 2**63},
        400,
        "'top_k': Input should be less than or equal to",
        "top_k",
    ),
    (
        {"prompt": [3], "max_tokens": 2, "seed": 2**64},
        400,
        "'seed': Input should be less than or equal to",
        "seed",
    ),
    (
        {"prompt": [3], "max_tokens": 2, "seed": -(2**63) - 1},
        400,
        "'seed': Input should be greater than",
        "seed",
    ),
    (b'{"prompt": "\\ud800", "max_tokens": 2}', 400, "'prompt' is not valid Unicode", "prompt"),
    (b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "nested more than 16 levels", None),
    ({"prompt": [3], "best_of": {}}, 400, "'best_of': Input should be a valid integer", "best_of"),
    ({"prompt": [3], "n": True}, 400, "'n': Input should be a valid integer", "n"),
    ({"prompt": [3], "echo": 0}, 400, "'echo': Input should be a valid boolean", "echo"),
    (
        {"prompt": [3], "stream_options": {"include_usage": "yes"}},
        400,
        "'stream_options.include_usage'",
        "stream_options",
    ),
    (
        b'{"prompt": [3], "temperature": NaN}',
        400,
        "'temperature': Input should be a finite number",
        "temperature",
    ),
]
BAD_CHAT = [
    ({"max_tokens": 4}, 400, "'messages' is required", "messages"),
    ({"messages": "hi"}, 400, "'messages': Input should be a valid list", "messages"),
    ({"messages": []}, 400, "'messages': List should have at least 1 item", "messages"),
    ({"messages": [{"content": "hi"}]}, 400, "'messages[0].role' is required", "messages"),
    ({"messages": [{"role": "user", "content": 7}]}, 400, "'messages[0].content'", "messages"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        400,
        "'tools' is not supported",
        "tools",
    ),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "has no chat template", "messages"),
]


def check_error(r, status, words, param):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"], error
    assert error["param"] == param and error["code"] == status and error["type"]


def test_bad_input_is_refused_and_running_requests_survive(server, chat_server, plain):
    survivor = {
        "prompt": [11, 12, 13],
        "max_tokens": 600,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    expected = reference(
        plain, [survivor["prompt"]], SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
    )[0]
    with server.http.stream("POST", "/v1/completions", json=survivor) as running:
        lines = running.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        for body, status, words, param in BAD_COMPLETIONS:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            check_error(server.http.post("/v1/completions", **kw), status, words, param)
        for body, status, words, param in BAD_CHAT:
            check_error(server.http.post("/v1/chat/completions", json=body), status, words, param)
        check_error(server.http.get("/v1/nowhere"), 404, "Not Found", None)
        check_error(server.http.get("/v1/completions"), 405, "Method Not Allowed", None)
        # HTTP requires Allow on a 405
        assert server.http.delete("/v1/models").headers["allow"] == "GET"
        assert server.metrics()["vllm:num_requests_running"] == 1, (
            "the survivor should still be running"
        )
        rest = [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in [first] + rest[:-1]]
    assert rest[-1] == "data: [DONE]"
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected
    server.wait_idle()
    # Chat-specific refusals on the model that has a chat template.
    too_long = " ".join(["w50"] * MAX_LEN)
    hi = [{"role": "user", "content": "w5"}]
    for body, words, param in (
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "'messages[0].content",
            "messages",
        ),
        (
            {"messages": [{"role": "user", "content": too_long}]},
            "leaves no room for a reply",
            "messages",
        ),
        ({"messages": hi, "top_logprobs": 2}, "top_logprobs needs logprobs: true", "top_logprobs"),
        (
            {"messages": hi, "logprobs": False, "top_logprobs": 0},
            "top_logprobs needs logprobs",
            "top_logprobs",
        ),
        (
            {"messages": hi, "logprobs": True, "top_logprobs": 21},
            "less than or equal to 20",
            "top_logprobs",
        ),
        (
            {"messages": hi, "n": 2, "best_of": 2},
            "'best_of'",
            None,
        ),  # not a chat field: ignored, 200
        (
            {"messages": hi, "response_format": {"type": "json_schema"}},
            "response_format of type json_schema needs its json_schema",
            "response_format",
        ),
        ({"messages": hi, "tools": [{"type": "function"}]}, "'tools' is not supported", "tools"),
    ):
        r = chat_server.http.post("/v1/chat/completions", json={**body, "max_tokens": 2})
        if param is None:
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
        else:
            check_error(r, 400, words, param)
    chat_server.wait_idle()


# ---------------------------------------------------------------------- clients that leave, a full
# queue
def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = server.metrics()
    body = {
        "prompt": [4, 5, 6],
        "max_tokens": MAX_LEN - 3,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):  # a few tokens arrive, then this client hangs up
            next(line for line in lines if line.startswith("data: "))
        assert server.metrics()["minicb:kv_blocks_used"] > 0
    after = server.wait_idle()
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[aborted] == before[aborted] + 1
    assert after["minicb:kv_blocks_free"] == CONFIG["num_blocks"]
    # A non-streaming client that times out is aborted as well.
    with pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/completions", json={**body, "stream": False}, timeout=0.3)
    assert server.wait_idle()[aborted] == before[aborted] + 2


def test_full_waiting_queue_answers_503(plain):
    body = {
        "prompt": [7, 8],
        "max_tokens": MAX_LEN - 2,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with serve(plain, max_num_seqs=1, max_waiting=1, trace_steps=20) as s:
        with s.http.stream("POST", "/v1/completions", json=body) as first:
            lines = first.iter_lines()  # keep it: a discarded iterator would close the connection
            next(line for line in lines if line.startswith("data: "))  # running
            with s.http.stream("POST", "/v1/completions", json=body) as second:
                assert second.status_code == 200  # accepted: it waits for the only slot
                m = s.metrics()
                assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == (1, 1)
                r = s.http.post("/v1/completions", json=body)
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert "max_waiting=1" in r.json()["error"]["message"]
        m = s.wait_idle()  # both clients left: the running and the waiting request were aborted
        assert (
            m['vllm:request_success_total{finished_reason="abort"}'] == 2
            and m["vllm:admission_rejections_total"] == 1
        )
        ok = s.http.post("/v1/completions", json={"prompt": [7], "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) >= 1
        assert 0 < len(s.engine.trace) <= 20  # the trace keeps only the newest steps


def test_engine_failure_fails_its_requests_and_the_server_keeps_serving(plain):
    with serve(plain) as s:
        execute = s.engine.runner.execute

        def broken(*args, **kwargs):
            raise RuntimeError("simulated device failure")

        s.engine.runner.execute = broken  # the engine loop is idle: it calls this on the next step
        r = s.http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 5})
        assert r.status_code == 500 and "simulated device failure" in r.json()["error"]["message"]
        s.engine.runner.execute = execute
        s.wait_idle()
        assert (
            s.http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 5}).status_code
            == 200
        )
        assert s.http.get("/health").status_code == 200


# ---------------------------------------------------------------------- the openai client
def test_openai_client(server, chat_server, plain):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == [server.name]
    out = client.completions.create(
        model=server.name, prompt=[5, 6, 7], max_tokens=8, temperature=0
    )
    want = reference(plain, [[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.choices[0].token_ids == want and out.usage.completion_tokens == len(want)
    # max_tokens 0: the prompt alone, an empty completion (the schema allows it)
    assert (
        client.completions.create(model=server.name, prompt=[5], max_tokens=0).choices[0].text == ""
    )
    chat = openai.OpenAI(
        base_url=chat_server.url + "/v1", api_key="unused", max_retries=0, timeout=30
    )
    messages = [{"role": "user", "content": "w60 w61 w62"}]
    whole = chat.chat.completions.create(
        model=chat_server.name, messages=messages, max_tokens=8, temperature=0
    )
    streamed = chat.chat.completions.create(
        model=chat_server.name,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


# ---------------------------------------------------------------------- the load test
def test_loadtest_reports_and_blocks_return(tmp_path, capsys):
    from minicb.serve import loadtest

    out = tmp_path / "load.json"
    common = ["--tiny", "--dtype", "float64", "--prompt-len", "8", "--json", str(out)]
    rc = loadtest.main(
        common
        + [
            "--concurrency",
            "1,4",
            "--num-requests",
            "8",
            "--max-tokens",
            "16",
            "--time-limit",
            "60",
        ]
    )
    result = json.loads(out.read_text())
    assert rc == 0 and result["ok"]
    for level in result["levels"]:
        assert (
            level["done"] == level["compared"] == level["same_output"] == 8
            and level["all_blocks_free"]
        )
        assert level["tokens_per_s"] > 0 and level["ttft_p50"] <= level["ttft_p99"]
    assert "req/s" in capsys.readouterr().out
    # A time limit that cuts the run short: the cancelled clients' requests are aborted, blocks come
    # back.
    rc = loadtest.main(
        common
        + [
            "--concurrency",
            "2",
            "--num-requests",
            "40",
            "--max-tokens",
            "200",
            "--time-limit",
            "0.5",
        ]
    )
    (level,) = json.loads(out.read_text())["levels"]
    assert rc == 0 and level["cancelled"] > 0 and level["done"] + level["cancelled"] == 40
    assert level["all_blocks_free"] and level["blocks_free"] == level["blocks_total"]
    with pytest.raises(ValueError, match="only targets loopback"):
        loadtest.check_loopback("http://10.0.0.1:8000")


# ---------------------------------------------------------------------- the embedded model
@pytest.mark.slow
def test_embedded_model_chat_stream_matches(tmp_path):
    loaded = load_model(None)
    with serve(loaded, dtype="float32", block_size=16, num_blocks=256) as s:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        body = {"messages": messages, "max_tokens": 24, "temperature": 0}
        whole = s.http.post("/v1/chat/completions", json=body).json()
        text = whole["choices"][0]["message"]["content"]
        assert "Paris" in text
        chunks = stream_completion(s, "/v1/chat/completions", body)
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
        s.wait_idle()


def test_stop_strings_over_http(chat_server):
    # Both endpoints, streamed and not: the text ends before the stop string, finish_reason "stop",
    # and the joined stream equals the whole reply.
    free = chat_server.http.post(
        "/v1/completions",
        json={"prompt": "w40 w41", "max_tokens": 10, "temperature": 0, "ignore_eos": True},
    ).json()["choices"][0]["text"]
    words = free.split()
    stop = next(w for i, w in enumerate(words) if i >= 2 and w not in words[:i])
    for path, body in (
        ("/v1/completions", {"prompt": "w40 w41"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w40 w41"}]}),
    ):
        body = {**body, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stop": [stop]}
        whole = chat_server.http.post(path, json=body).json()["choices"][0]
        text = whole["text"] if "text" in whole else whole["message"]["content"]
        assert whole["finish_reason"] == "stop" and stop not in text
        pieces = stream_completion(chat_server, path, body)
        joined = "".join(
            p["choices"][0]["text"]
            if "text" in p["choices"][0]
            else p["choices"][0]["delta"].get("content") or ""
            for p in pieces
        )
        assert joined == text and pieces[-1]["choices"][0]["finish_reason"] == "stop"
        if (
            path == "/v1/completions"
        ):  # the same prompt as the free run: cut right before the stop string
            assert text == free[: free.index(stop)]

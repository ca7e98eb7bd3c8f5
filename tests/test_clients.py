"""The request bodies that lm-eval 0.4.13 and guidellm 0.8.1 send, byte for byte as captured from
the real tools against `python -m minicb serve`, replayed against the server; each test asserts the
response fields that client reads (neither package is needed: CI replays what they send). The
README's recipes run the tools themselves; tests/test_server_sampling.py holds lm-eval's
loglikelihood body (echo + logprobs) in both its prompt forms."""

import pytest
import torch
from reference import add_word_tokenizer
from serving import CONFIG, one_torch_thread, serve, sse_events  # noqa: F401

from minicb import LLM, SamplingParams
from minicb.engine.llm import chat_token_ids
from minicb.model_executor.loader import load_model, save_tiny_model

MAX_LEN = 256
EOS = "</s>"  # the word tokenizer's EOS string, which lm-eval appends to every stop list


@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    path = save_tiny_model(
        tmp_path_factory.mktemp("clients"), seed=9, max_position_embeddings=MAX_LEN
    )
    return load_model(add_word_tokenizer(path), torch.float64)


@pytest.fixture(scope="module")
def server(worded):
    with serve(worded, max_model_len=MAX_LEN) as s:
        yield s


def offline_text(worded, prompt_ids, params) -> tuple[str, list[int]]:
    (out,) = LLM.from_loaded(worded, **CONFIG).generate([prompt_ids], params, use_tqdm=False)
    return out.outputs[0].text, out.outputs[0].token_ids


# ---------------------------------------------------------------------- lm-eval, generate_until
def lm_eval_generate_body(model, prompt):
    # lm_eval/models/openai_completions.py, LocalCompletionsAPI._create_payload(generate=True) for a
    # task with until ["\n"]: stop gets the EOS string appended; seed 1234 always.
    return {
        "prompt": prompt,
        "model": model,
        "max_tokens": 8,
        "temperature": 0.0,
        "stop": ["\n", EOS],
        "seed": 1234,
    }


@pytest.mark.parametrize("form", ["text", "token ids, batched"])
def test_lm_eval_generate_until(server, worded, form):
    texts = ["w10 w11 w12", "w40 w41"]
    ids = [worded.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    # --batch_size 2 with tokenized requests: a list of id lists
    prompt = texts[0] if form == "text" else ids
    r = server.http.post("/v1/completions", json=lm_eval_generate_body(server.name, prompt))
    assert r.status_code == 200, r.text
    body = r.json()
    # lm-eval's parse_generations: choices placed by "index", their "text" taken as the answer
    got = [None] * len(body["choices"])
    for choice in body["choices"]:
        got[choice["index"]] = choice["text"]
    want = [
        offline_text(
            worded, p, SamplingParams(max_tokens=8, temperature=0, stop=["\n", EOS], seed=1234)
        )[0]
        for p in (ids[:1] if form == "text" else ids)
    ]
    assert got == want


# ---------------------------------------------------------------------- guidellm, streamed
def guidellm_chat_body(model, text):
    # guidellm's openai_http backend, request_format /v1/chat/completions (as its JSON report
    # records it)
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": 12,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
    }


def guidellm_completions_body(model, text):
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": 12,
        "ignore_eos": True,
        "prompt": text,
    }


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_guidellm_streamed_request(server, worded, chat):
    text = "w20 w21 w22 w23"
    body = (guidellm_chat_body if chat else guidellm_completions_body)(server.name, text)
    with server.http.stream(
        "POST", "/v1/chat/completions" if chat else "/v1/completions", json=body
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    prompt_ids = (
        chat_token_ids(worded.tokenizer, [{"role": "user", "content": text}])
        if chat
        else worded.tokenizer.encode(text, add_special_tokens=False)
    )
    # What guidellm reads: the response id, each chunk's text (delta.content / text), and usage.
    assert all(e["id"] == events[0]["id"] for e in events) and events[0]["id"].startswith(
        "chatcmpl-" if chat else "cmpl-"
    )
    pieces = [
        c["delta"].get("content") or "" if chat else c["text"] for e in events for c in e["choices"]
    ]
    streamed_tokens = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert len(streamed_tokens) == 12 and len("".join(pieces)) > 0
    # continuous_usage_stats: every chunk with tokens carries the counts so far (a chunk may hold
    # several steps' tokens when the client reads slower than the engine steps)
    with_tokens = [e for e in events if any(c.get("token_ids") for c in e["choices"])]
    assert all(e.get("usage") for e in with_tokens)
    counts = [e["usage"]["completion_tokens"] for e in with_tokens]
    seen = [
        sum(len(c["token_ids"]) for e in with_tokens[: i + 1] for c in e["choices"])
        for i in range(len(with_tokens))
    ]
    assert counts == seen and counts[-1] == 12
    last = events[-1]
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 12,
        "total_tokens": len(prompt_ids) + 12,
    }


def test_guidellm_greedy_chat_text_equals_the_offline_engine(server, worded):
    body = {**guidellm_chat_body(server.name, "w50 w51"), "temperature": 0}
    with server.http.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    prompt_ids = chat_token_ids(worded.tokenizer, [{"role": "user", "content": "w50 w51"}])
    assert (
        text
        == offline_text(
            worded, prompt_ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        )[0]
    )


def test_request_log_holds_the_servers_own_times(worded, tmp_path):
    # python -m minicb serve --request-log FILE: one JSON line per finished request, matched to a
    # client's records by the response id (bench/clients/compare.py sets them beside guidellm's).
    import json
    from contextlib import ExitStack

    import httpx

    from minicb import Engine, EngineConfig
    from minicb.serve.app import build_app
    from minicb.serve.cli import ServerThread
    from minicb.serve.engine_loop import AsyncEngine

    log = tmp_path / "requests.jsonl"
    engine = Engine(EngineConfig(model=worded.name, max_model_len=MAX_LEN, **CONFIG), worded)
    async_engine = AsyncEngine(engine, request_log=str(log))
    with ExitStack() as stack:
        url = stack.enter_context(ServerThread(build_app(async_engine)))
        http = stack.enter_context(httpx.Client(base_url=url, timeout=30))
        ids = [
            http.post(
                "/v1/completions", json=guidellm_completions_body(worded.name, f"w{30 + i} w31")
            ).text
            for i in range(2)
        ]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 2 and all(
        '"cmpl-' + rec["stream_id"] + '"' in body for rec, body in zip(lines, ids)
    )
    for rec in lines:
        assert rec["output_tokens"] == 12 and rec["prompt_tokens"] == 2
        assert rec["received"] <= rec["arrival"] <= rec["first_token"] <= rec["finish"]
        assert rec["ttft_s"] >= rec["engine_ttft_s"] > 0 and rec["tpot_s"] > 0


def test_compare_matches_guidellm_requests_to_the_servers_by_response_id(tmp_path):
    import json

    from minicb.bench.clients.compare import load, rows, table

    server = [
        {
            "stream_id": str(i),
            "received": 10.0 + i,
            "arrival": 10.1 + i,
            "first_token": 10.5 + i,
            "finish": 12.0 + i,
            "ttft_s": 0.5,
            "engine_ttft_s": 0.4,
            "tpot_s": 0.05,
        }
        for i in range(3)
    ]
    (tmp_path / "server.jsonl").write_text("".join(json.dumps(r) + "\n" for r in server))
    # 7: a request the server never logged
    client = [
        {
            "response_id": f"chatcmpl-{i}",
            "time_to_first_token_ms": 510.0,
            "inter_token_latency_ms": 50.5,
            "request_latency": 2.02,
        }
        for i in (1, 2, 7)
    ]
    bench = {
        "config": {"strategy": {"type_": "concurrent", "streams": 4}},
        "requests": {"successful": client},
    }
    (tmp_path / "g.json").write_text(json.dumps({"benchmarks": [bench]}))
    found = load(str(tmp_path / "g.json"), str(tmp_path / "server.jsonl"))
    pairs = found["concurrent@4"]
    assert list(found) == ["concurrent@4"] and [s["stream_id"] for _, s in pairs] == ["1", "2"]
    (what, c, s), *_ = rows(pairs)
    assert c == [510.0, 510.0] and s == [500.0, 500.0]
    assert "2 requests seen by both" in table(pairs)

"""What the server's sampling fields do, seen through the openai client (issues 12 and 20): n, stop,
logprobs, penalties, several prompts in one request, echo. Both endpoints, streamed and not; every
answer is compared with the offline engine (`LLM.generate`) on the same float64 weights. Every loop
below is bounded in count and time.
"""

import json
from dataclasses import dataclass, field

import pytest
import torch
from reference import add_word_tokenizer
from serving import CONFIG, one_torch_thread, serve  # noqa: F401

from minicb import LLM, CompletionOutput, RequestOutput, SamplingParams
from minicb.engine.llm import chat_token_ids
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.outputs import Logprob
from minicb.serve.protocol import UNSUPPORTED
from minicb.serve.responses import Choices, Prompt

openai = pytest.importorskip("openai")

MAX_LEN = 256
STREAMED = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
ENDPOINTS = pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])


@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    path = save_tiny_model(
        tmp_path_factory.mktemp("sampling"), seed=5, max_position_embeddings=MAX_LEN
    )
    return load_model(add_word_tokenizer(path), torch.float64)


@pytest.fixture(scope="module")
def server(worded):
    with serve(worded, max_model_len=MAX_LEN) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def offline(loaded, prompts, params: SamplingParams):
    """The offline engine's RequestOutputs for the same prompts (token ids) and parameters."""
    return LLM.from_loaded(loaded, **CONFIG).generate(prompts, params, use_tqdm=False)


@dataclass
class Got:
    """One choice as the client saw it, the same shape whether it came whole or in chunks."""

    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # the sampled token's logprob, per token
    # {token text: logprob} of the alternatives shown, per token
    tops: list = field(default_factory=list)
    tokens: list = field(default_factory=list)  # completions: each token's text
    text_offset: list = field(default_factory=list)  # completions


def add_logprobs(got: Got, lp, chat: bool) -> None:
    if lp is None:
        return
    if chat:
        for t in lp.content:
            got.logprobs.append(t.logprob)
            got.tops.append({a.token: a.logprob for a in t.top_logprobs})
            got.tokens.append(t.token)
    else:
        got.logprobs += lp.token_logprobs
        got.tops += lp.top_logprobs
        got.tokens += lp.tokens
        got.text_offset += lp.text_offset


def ask(client, chat: bool, stream: bool, prompt, **kw) -> tuple[dict[int, Got], object]:
    """{choice index: Got} and the usage, from one request through the openai client."""
    model = client.models.list().data[0].id
    if chat:
        call = lambda **k: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], **k
        )
    else:
        call = lambda **k: client.completions.create(model=model, prompt=prompt, **k)
    got: dict[int, Got] = {}
    if not stream:
        out = call(**kw)
        for c in out.choices:
            g = got[c.index] = Got(
                c.message.content if chat else c.text, c.token_ids, c.finish_reason
            )
            add_logprobs(g, c.logprobs, chat)
        return got, out.usage
    usage = None
    for chunk in call(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            g = got.setdefault(c.index, Got())
            g.text += (c.delta.content or "") if chat else c.text
            g.token_ids += getattr(c, "token_ids", None) or []  # the role chunk has none
            g.finish_reason = c.finish_reason or g.finish_reason
            add_logprobs(g, c.logprobs, chat)
    return got, usage


def prompt_ids(worded, chat: bool, prompt: str) -> list[int]:
    if chat:
        return chat_token_ids(worded.tokenizer, [{"role": "user", "content": prompt}])
    return worded.tokenizer.encode(prompt, add_special_tokens=False)


# ---------------------------------------------------------------------- n
@ENDPOINTS
@STREAMED
def test_greedy_n_gives_identical_choices(client, server, worded, chat, stream):
    got, usage = ask(
        client,
        chat,
        stream,
        "w30 w31 w32",
        n=3,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    (want,) = offline(
        worded,
        [prompt_ids(worded, chat, "w30 w31 w32")],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    )
    assert sorted(got) == [0, 1, 2]
    for g in got.values():
        assert g.token_ids == want.outputs[0].token_ids and g.text == want.outputs[0].text
        assert g.finish_reason == "length"
    assert usage.completion_tokens == 18 and usage.prompt_tokens == len(want.prompt_token_ids)
    server.wait_idle()


@ENDPOINTS
@STREAMED
def test_seeded_n_equals_requests_with_seed_and_seed_plus_one(client, worded, chat, stream):
    got, _ = ask(
        client,
        chat,
        stream,
        "w40 w41",
        n=2,
        seed=123,
        max_tokens=8,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    ids = prompt_ids(worded, chat, "w40 w41")
    for i in range(2):
        (want,) = offline(
            worded,
            [ids],
            SamplingParams(max_tokens=8, temperature=1.0, seed=123 + i, ignore_eos=True),
        )
        assert got[i].token_ids == want.outputs[0].token_ids and got[i].text == want.outputs[0].text
        alone, _ = ask(
            client,
            chat,
            stream,
            "w40 w41",
            seed=123 + i,
            max_tokens=8,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        assert alone[0].token_ids == got[i].token_ids
    assert got[0].token_ids != got[1].token_ids  # two seeds, two samples


# ---------------------------------------------------------------------- stop
@ENDPOINTS
@STREAMED
def test_stop_string_ends_every_choice(client, worded, chat, stream):
    ids = prompt_ids(worded, chat, "w50 w51")
    (free,) = offline(worded, [ids], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    words = free.outputs[0].text.split()
    stop = next(w for i, w in enumerate(words) if i >= 2 and w not in words[:i])
    got, _ = ask(
        client,
        chat,
        stream,
        "w50 w51",
        n=2,
        stop=[stop],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    for g in got.values():
        assert (
            g.finish_reason == "stop"
            and g.text == free.outputs[0].text[: free.outputs[0].text.index(stop)]
        )


# ---------------------------------------------------------------------- logprobs
@ENDPOINTS
@STREAMED
def test_logprobs_equal_the_offline_engines(client, worded, chat, stream):
    k = 3
    kw = dict(logprobs=True, top_logprobs=k) if chat else dict(logprobs=k)
    got, _ = ask(client, chat, stream, "w60 w61 w62", max_tokens=6, temperature=0, **kw)
    (want,) = offline(
        worded,
        [prompt_ids(worded, chat, "w60 w61 w62")],
        SamplingParams(max_tokens=6, temperature=0, logprobs=k),
    )
    sample, g = want.outputs[0], got[0]
    assert g.token_ids == sample.token_ids and len(g.logprobs) == len(g.tops) == len(
        sample.token_ids
    )
    for token, entry, lp, top, text in zip(
        sample.token_ids, sample.logprobs, g.logprobs, g.tops, g.tokens
    ):
        assert (
            lp == pytest.approx(entry[token].logprob, abs=1e-12)
            and text == entry[token].decoded_token
        )
        best = {e.decoded_token: e.logprob for e in entry.values() if e.rank <= k}
        assert top.keys() >= best.keys() and all(
            top[t] == pytest.approx(v, abs=1e-12) for t, v in best.items()
        )
        # greedy: the sampled token is the best one, exactly (lm-eval's is_greedy)
        assert lp == max(top.values())
    if not chat:  # each token's text starts where text_offset says
        assert all(g.text[o:].lstrip().startswith(t) for o, t in zip(g.text_offset, g.tokens))


def test_logprobs_with_sampling_and_n(client, worded):
    got, _ = ask(
        client,
        False,
        True,
        "w60 w61",
        n=2,
        seed=7,
        max_tokens=5,
        temperature=1.0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    for i in range(2):
        (want,) = offline(
            worded,
            [prompt_ids(worded, False, "w60 w61")],
            SamplingParams(max_tokens=5, temperature=1.0, seed=7 + i, logprobs=0, ignore_eos=True),
        )
        sample = want.outputs[0]
        assert got[i].token_ids == sample.token_ids
        assert got[i].logprobs == pytest.approx(
            [e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs)], abs=1e-12
        )
        assert all(len(top) == 1 for top in got[i].tops)  # logprobs 0: the sampled token only


# ---------------------------------------------------------------------- penalties
def repetitive_prompt(worded) -> str:
    """A prompt whose greedy continuation repeats a token, so that a penalty has something to
    change."""
    for i in range(6, 60):
        prompt = " ".join([f"w{i}", f"w{i + 1}"] * 3)
        (out,) = offline(
            worded,
            [prompt_ids(worded, False, prompt)],
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        )
        ids = out.outputs[0].token_ids
        if len(set(ids)) < len(ids) - 2:
            return prompt
    raise AssertionError("no prompt among 54 makes this tiny model repeat itself")


@ENDPOINTS
@STREAMED
def test_penalties_change_greedy_output_as_offline(client, worded, chat, stream):
    prompt = repetitive_prompt(worded)
    ids = prompt_ids(worded, chat, prompt)
    plain, _ = ask(
        client, chat, stream, prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    for openai_fields, vllm_fields in (
        ({"frequency_penalty": 1.5}, {}),
        ({"presence_penalty": 1.5}, {}),
        ({}, {"repetition_penalty": 1.8}),
    ):  # vLLM's fields go in extra_body
        got, _ = ask(
            client,
            chat,
            stream,
            prompt,
            max_tokens=12,
            temperature=0,
            **openai_fields,
            extra_body={"ignore_eos": True, **vllm_fields},
        )
        fields = {**openai_fields, **vllm_fields}
        (want,) = offline(
            worded, [ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **fields)
        )
        assert got[0].token_ids == want.outputs[0].token_ids != plain[0].token_ids, fields


def test_logit_bias_and_min_tokens(client, server, worded):
    got, _ = ask(
        client, False, False, "w20 w21", max_tokens=4, temperature=0, logit_bias={"77": 100}
    )
    assert got[0].token_ids == [77] * 4
    eos = worded.eos_token_ids
    got, _ = ask(
        client,
        False,
        False,
        "w20 w21",
        max_tokens=6,
        temperature=0,
        logit_bias={str(t): 100 for t in eos},
        extra_body={"min_tokens": 3},
    )
    # EOS forbidden for 3 tokens, then taken
    assert len(got[0].token_ids) == 4 and got[0].finish_reason == "stop"
    server.wait_idle()


# ---------------------------------------------------------------------- several prompts
@STREAMED
def test_several_prompts_in_one_request(client, server, worded, stream):
    texts = ["w10 w11", "w12", "w13 w14 w15"]
    got, usage = ask(
        client,
        False,
        stream,
        texts,
        n=2,
        seed=5,
        max_tokens=5,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(got) == list(range(6))  # choice index = prompt index * n + sample index
    prompts = [prompt_ids(worded, False, t) for t in texts]
    for p, ids in enumerate(prompts):
        for i in range(2):
            (want,) = offline(
                worded,
                [ids],
                SamplingParams(max_tokens=5, temperature=1.0, seed=5 + i, ignore_eos=True),
            )
            assert (
                got[2 * p + i].token_ids == want.outputs[0].token_ids
                and got[2 * p + i].text == want.outputs[0].text
            )
    assert usage.prompt_tokens == sum(map(len, prompts)) and usage.completion_tokens == 6 * 5
    as_ids, _ = ask(
        client,
        False,
        stream,
        prompts,
        n=2,
        seed=5,
        max_tokens=5,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert {i: g.token_ids for i, g in as_ids.items()} == {i: g.token_ids for i, g in got.items()}
    server.wait_idle()


def test_several_prompts_are_all_or_nothing_and_a_disconnect_aborts_them_all(server):
    before = server.metrics()
    r = server.http.post(
        "/v1/completions", json={"prompt": [[5, 6], [7] * (MAX_LEN + 1)], "max_tokens": 2}
    )
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "prompt 1: prompt has 257 tokens"
    )
    after = server.wait_idle()
    # prompt 0 never ran
    assert after["minicb:engine_steps_total"] == before["minicb:engine_steps_total"]
    body = {
        "prompt": [[5, 6], [8, 9]],
        "n": 2,
        "max_tokens": MAX_LEN - 3,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with server.http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        seen = set()
        while len(seen) < 4:  # every choice streams, then this client hangs up
            line = next(line for line in lines if line.startswith("data: "))
            seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
        assert server.metrics()["vllm:num_requests_running"] >= 2
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    assert server.wait_idle()[aborted] == after[aborted] + 2


def test_metrics_count_every_samples_tokens(client, server):
    before = server.wait_idle()
    ask(
        client,
        False,
        False,
        ["w10", "w11"],
        n=3,
        max_tokens=4,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    after = server.wait_idle()
    assert (
        after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 2 * 3 * 4
    )


# ---------------------------------------------------------------------- echo
@STREAMED
def test_echo_with_logprobs_covers_prompt_then_output(client, worded, stream):
    prompt = "w70 w71 w72 w73"
    got, usage = ask(
        client, False, stream, prompt, echo=True, logprobs=2, max_tokens=3, temperature=0
    )
    ids = prompt_ids(worded, False, prompt)
    (want,) = offline(
        worded, [ids], SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2)
    )
    g, sample = got[0], want.outputs[0]
    assert g.text == prompt + sample.text and g.token_ids == sample.token_ids
    assert g.tokens == prompt.split() + [
        sample.logprobs[i][t].decoded_token for i, t in enumerate(sample.token_ids)
    ]
    assert g.logprobs[0] is None and g.tops[0] is None  # nothing predicts the first prompt token
    entries = want.prompt_logprobs[1:] + sample.logprobs
    for token, entry, lp, top in zip(
        ids[1:] + sample.token_ids, entries, g.logprobs[1:], g.tops[1:]
    ):
        assert lp == pytest.approx(entry[token].logprob, abs=1e-12) and len(top) in (2, 3)
    assert g.text_offset[: len(ids)] == [0, 3, 7, 11] and g.text_offset[len(ids)] == len(prompt)
    assert usage.completion_tokens == 3 and usage.prompt_tokens == len(ids)


@STREAMED
def test_echo_with_max_tokens_0_returns_the_prompt_alone(client, server, worded, stream):
    prompt = "w80 w81 w82"
    got, usage = ask(client, False, stream, prompt, echo=True, logprobs=1, max_tokens=0)
    ids = prompt_ids(worded, False, prompt)
    (want,) = offline(worded, [ids], SamplingParams(max_tokens=1, prompt_logprobs=1))
    g = got[0]
    assert g.text == prompt and g.token_ids == [] and g.finish_reason == "length"
    assert g.logprobs[0] is None and g.logprobs[1:] == pytest.approx(
        [e[t].logprob for t, e in zip(ids[1:], want.prompt_logprobs[1:])], abs=1e-12
    )
    assert usage.completion_tokens == 0 and usage.prompt_tokens == 3
    server.wait_idle()


def test_prompt_logprobs_in_vllms_format(server, worded):
    r = server.http.post(
        "/v1/completions", json={"prompt": "w5 w6 w7", "max_tokens": 1, "prompt_logprobs": 1}
    )
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == 3 and entries[0] is None and all(entries[1:])
    assert entries[1][str(worded.tokenizer.convert_tokens_to_ids("w6"))]["decoded_token"] == "w6"
    chat = server.http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "w5"}],
            "max_tokens": 1,
            "prompt_logprobs": 0,
        },
    ).json()
    assert (
        chat["prompt_logprobs"][0] is None
        and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    )


# ---------------------------------------------------------------------- what is still refused
@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "w5", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "w5", "suffix": "w9"}, "suffix"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "w5"}], "tools": [{"type": "function"}]},
            "tools",
        ),
    ],
)
def test_unsupported_fields_get_a_clear_400_naming_them(server, path, body, param):
    r = server.http.post(path, json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param
    assert error["message"].replace("'", "").startswith(f"{param} is not supported by minicb"), (
        error
    )
    # all that is left
    assert sorted(UNSUPPORTED) == ["best_of", "suffix", "tools"]


@pytest.mark.parametrize("form", ["text", "token ids"])
def test_lm_eval_loglikelihood_request(server, worded, form):
    # lm-eval's local-completions body for two (context, continuation) pairs, and what it reads
    # back:
    # the continuation's logprobs (token_logprobs[ctxlen:-1]) and whether each was the greedy
    # choice.
    pairs = [("w10 w11", "w12 w13"), ("w20", "w21")]
    ids = [(prompt_ids(worded, False, c), prompt_ids(worded, False, x)) for c, x in pairs]
    prompts = [f"{c} {x}" for c, x in pairs] if form == "text" else [c + x for c, x in ids]
    body = {
        "model": server.name,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    for choice, (context, continuation) in zip(
        sorted(r.json()["choices"], key=lambda c: c["index"]), ids
    ):
        lp = choice["logprobs"]
        got, tops = lp["token_logprobs"][len(context) : -1], lp["top_logprobs"][len(context) : -1]
        (want,) = offline(
            worded, [context + continuation], SamplingParams(max_tokens=1, prompt_logprobs=1)
        )
        entries = want.prompt_logprobs[len(context) :]
        assert got == pytest.approx(
            [e[t].logprob for t, e in zip(continuation, entries)], abs=1e-12
        )
        # lm-eval's test: ==
        is_greedy = all(token_lp == max(top.values()) for token_lp, top in zip(got, tops))
        assert is_greedy == all(e[t].rank == 1 for t, e in zip(continuation, entries))


def test_without_a_tokenizer_tokens_are_spelled_as_ids(tmp_path):
    plain = load_model(
        save_tiny_model(tmp_path, seed=5, max_position_embeddings=MAX_LEN), torch.float64
    )
    with serve(plain, max_model_len=MAX_LEN) as s:
        r = s.http.post(
            "/v1/completions",
            json={
                "prompt": [[4, 5], [6]],
                "echo": True,
                "logprobs": 1,
                "max_tokens": 2,
                "temperature": 0,
            },
        ).json()
        for choice, prompt in zip(r["choices"], ([4, 5], [6])):
            lp = choice["logprobs"]
            # vLLM's spelling
            assert lp["tokens"] == [f"token_id:{t}" for t in prompt + choice["token_ids"]]
            assert choice["text"] == "" and lp["text_offset"] == [0] * len(lp["tokens"])
        s.wait_idle()


def test_tokens_that_share_a_text_keep_the_best_logprob():
    # Byte-level BPE splits a character over tokens whose texts all read U+FFFD: {text: logprob}
    # must keep the best of them, or lm-eval's is_greedy (logprob == max(top)) fails for a greedy
    # token.
    entry = {7: Logprob(-0.5, 1, "\ufffd"), 9: Logprob(-2.0, 2, "\ufffd")}
    out = RequestOutput(
        "0-0",
        None,
        [1],
        None,
        [CompletionOutput(0, "", [7], logprobs=[entry], finish_reason="length")],
        finished=True,
    )
    (choice,) = Choices([Prompt([1])], None, chat=False, stream=False, n=1, num_logprobs=2).whole(
        {0: out}
    )
    assert choice["logprobs"]["top_logprobs"] == [{"\ufffd": -0.5}] and choice["logprobs"][
        "token_logprobs"
    ] == [-0.5]

"""Incremental detokenization (minicb/engine/detokenizer.py) on a byte-level tokenizer, where one
character can take up to four tokens: the stream never shows half a character, and its pieces add up
to the text that decoding everything at once gives, byte for byte."""

import random

import pytest

from minicb.engine.detokenizer import IncrementalDetokenizer

TEXT = "naïve café, 日本語 and 😀 — ok"


@pytest.fixture(scope="module")
def byte_tokenizer():
    """Every byte is one token (ids 0-255), as in a byte-level BPE with no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def stream(tokenizer, ids, chunk_sizes):
    detok, deltas, i = IncrementalDetokenizer(tokenizer), [], 0
    for n in chunk_sizes:
        part, i = ids[i : i + n], i + n
        deltas.append(detok.add(part, finished=i >= len(ids)))
    return detok, deltas


def test_one_token_at_a_time(byte_tokenizer):
    ids = byte_tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT)  # several characters take several tokens
    detok, deltas = stream(byte_tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == detok.text == byte_tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)  # half a character is held back, never shown
    assert deltas.count("") >= 1  # ... which means some steps emitted nothing
    assert detok.read_offset - detok.prefix_offset <= 4  # the window stays small


@pytest.mark.parametrize("seed", range(5))
def test_any_chunking_gives_the_same_text(byte_tokenizer, seed):
    ids = byte_tokenizer.encode(TEXT)
    rng = random.Random(seed)
    sizes = []
    while sum(sizes) < len(ids):
        sizes.append(rng.randint(1, 5))
    _, deltas = stream(byte_tokenizer, ids, sizes)
    assert "".join(deltas) == TEXT


def test_invalid_bytes_come_out_at_the_end(byte_tokenizer):
    # A sampled model can emit a byte that never completes a character: it is held back while the
    # request runs and flushed (as U+FFFD) when it finishes, so no text is ever lost.
    # byte 0xC3, alone
    ids = byte_tokenizer.encode("ab") + [byte_tokenizer.convert_tokens_to_ids("Ã")]
    detok, deltas = stream(byte_tokenizer, ids, [1, 1, 1])
    assert deltas[:2] == ["a", "b"] and detok.text == byte_tokenizer.decode(ids) == "ab\ufffd"


def test_a_streamed_reply_equals_the_whole_reply_byte_for_byte(byte_tokenizer, tmp_path):
    # A tiny model over the 256 byte tokens, sampled with a seed: its output is mostly broken-up
    # multi-byte characters. The server's stream, joined, must equal the non-streamed text exactly.
    import json

    import torch
    from serving import serve, sse_events

    from minicb.model_executor.loader import load_model, save_tiny_model

    path = save_tiny_model(
        tmp_path / "bytes", seed=4, vocab_size=256, bos_token_id=0, eos_token_id=1
    )
    byte_tokenizer.save_pretrained(path)
    loaded = load_model(path, torch.float64)
    body = {"prompt": "日本", "max_tokens": 40, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    with serve(loaded) as s:
        whole = s.http.post("/v1/completions", json=body).json()["choices"][0]
        with s.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            pieces = sse_events(r)
    streamed = "".join(p["choices"][0]["text"] for p in pieces)
    assert [t for p in pieces for t in p["choices"][0]["token_ids"]] == whole["token_ids"]
    assert (
        streamed.encode()
        == whole["text"].encode()
        == byte_tokenizer.decode(whole["token_ids"]).encode()
    )
    assert any(len(t.encode()) > 1 for t in streamed)  # multi-byte characters were in the stream
    assert json.dumps(streamed)  # nothing a JSON encoder refuses (e.g. a lone surrogate)


def test_the_same_over_an_engine_core_process(byte_tokenizer, tmp_path):
    # The server's default: the core process sends token ids, the HTTP process detokenizes them.
    from contextlib import ExitStack

    import httpx
    from serving import sse_events

    from minicb import EngineConfig
    from minicb.model_executor.loader import save_tiny_model
    from minicb.serve.app import build_app
    from minicb.serve.cli import ServerThread
    from minicb.serve.engine_core import RemoteEngine
    from minicb.serve.engine_loop import AsyncEngine

    path = save_tiny_model(
        tmp_path / "bytes", seed=4, vocab_size=256, bos_token_id=0, eos_token_id=1
    )
    byte_tokenizer.save_pretrained(path)
    engine = RemoteEngine(
        EngineConfig(model=str(path), dtype="float64", block_size=4, num_blocks=128)
    )
    body = {"prompt": "日本", "max_tokens": 40, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    with ExitStack() as stack:
        http = stack.enter_context(
            httpx.Client(
                base_url=stack.enter_context(ServerThread(build_app(AsyncEngine(engine)))),
                timeout=30,
            )
        )
        whole = http.post("/v1/completions", json=body).json()["choices"][0]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            pieces = sse_events(r)
    streamed = "".join(p["choices"][0]["text"] for p in pieces)
    assert (
        streamed.encode()
        == whole["text"].encode()
        == byte_tokenizer.decode(whole["token_ids"]).encode()
    )
    assert any(len(t.encode()) > 1 for t in streamed)

"""Incremental detokenization (minicb/engine/detokenizer.py) on a byte-level tokenizer, where one
character can take up to four tokens: the stream never shows half a character, and its pieces add up
to the text that decoding everything at once gives, byte for byte."""

import random

import pytest

from minicb.engine.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    new_detokenizer,
)

TEXT = "naïve café, 日本語 and 😀 — ok"
BOTH = [IncrementalDetokenizer, FastIncrementalDetokenizer]  # the Python window, the Rust stream


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


def stream(tokenizer, ids, chunk_sizes, kind=IncrementalDetokenizer, **kwargs):
    detok, deltas, i = kind(tokenizer, **kwargs), [], 0
    for n in chunk_sizes:
        part, i = ids[i : i + n], i + n
        deltas.append(detok.add(part, finished=i >= len(ids)))
    return detok, deltas


@pytest.mark.parametrize("kind", BOTH)
def test_one_token_at_a_time(byte_tokenizer, kind):
    ids = byte_tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT)  # several characters take several tokens
    detok, deltas = stream(byte_tokenizer, ids, [1] * len(ids), kind)
    assert "".join(deltas) == detok.text == byte_tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)  # half a character is held back, never shown
    assert deltas.count("") >= 1  # ... which means some steps emitted nothing
    assert detok.read_offset - detok.prefix_offset <= 4  # the window stays small


@pytest.mark.parametrize("kind", BOTH)
@pytest.mark.parametrize("seed", range(5))
def test_any_chunking_gives_the_same_text(byte_tokenizer, seed, kind):
    ids = byte_tokenizer.encode(TEXT)
    rng = random.Random(seed)
    sizes = []
    while sum(sizes) < len(ids):
        sizes.append(rng.randint(1, 5))
    _, deltas = stream(byte_tokenizer, ids, sizes, kind)
    assert "".join(deltas) == TEXT


@pytest.mark.parametrize("kind", BOTH)
def test_invalid_bytes_come_out_at_the_end(byte_tokenizer, kind):
    # A sampled model can emit a byte that never completes a character: it is held back while the
    # request runs and flushed (as U+FFFD) when it finishes, so no text is ever lost.
    # byte 0xC3, alone
    ids = byte_tokenizer.encode("ab") + [byte_tokenizer.convert_tokens_to_ids("Ã")]
    detok, deltas = stream(byte_tokenizer, ids, [1, 1, 1], kind)
    assert deltas[:2] == ["a", "b"] and detok.text == byte_tokenizer.decode(ids) == "ab\ufffd"


CORPUS = [
    "The cat sat on the mat. The cat's naïve café, 日本語 and 😀 — ok.",
    "A stream of tokens becomes text; half of a character waits for the rest of it.",
    "Über straße, żółw, ça va? Ελληνικά και русский текст.",
]


def trained(kind: str):
    """A small tokenizer trained here, of one of the two families real models use: "bytelevel"
    (GPT-2, Llama 3, SmolLM2: byte-level BPE) or "metaspace" (Llama 2, Mistral: SentencePiece-style
    BPE whose decoder drops the first leading space and falls back to <0xNN> byte tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<s>", "</s>", "<unk>"]
    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        alphabet, special = [], special + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=special, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("family", ["bytelevel", "metaspace"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_rust_stream_gives_what_the_python_window_gives(family, skip_special_tokens):
    # Random ids, special tokens and lone byte tokens among them (what a sampled model can emit).
    # Fed a token at a time, both detokenizers give the same deltas step by step; fed several at
    # once (speculative decoding's accepted drafts), the stream still steps token by token, so the
    # deltas may split differently, but the text is the same.
    tokenizer = trained(family)
    assert isinstance(new_detokenizer(tokenizer), FastIncrementalDetokenizer)
    rng = random.Random(0)
    kw = dict(skip_special_tokens=skip_special_tokens)
    vocab = range(len(tokenizer))
    if family == "metaspace":  # no lone <0xNN> tokens (see below)
        vocab = [i for i in vocab if not tokenizer.convert_ids_to_tokens(i).startswith("<0x")]
    for _ in range(200):
        ids = rng.choices(vocab, k=rng.randint(1, 30))
        for sizes in ([1] * len(ids), [rng.randint(1, 3) for _ in ids]):
            slow, slow_deltas = stream(tokenizer, ids, sizes, IncrementalDetokenizer, **kw)
            fast, fast_deltas = stream(tokenizer, ids, sizes, FastIncrementalDetokenizer, **kw)
            assert "".join(fast_deltas) == fast.text == slow.text, ids
            if max(sizes) == 1:
                assert fast_deltas == slow_deltas, ids
            assert fast.text == tokenizer.decode(ids, **kw), ids
    # A byte-fallback decoder turns a run of <0xNN> tokens that is not valid UTF-8 into one U+FFFD
    # per byte, valid bytes too, so the text of random byte tokens depends on what follows them:
    # there no incremental text equals the whole decode (vLLM's neither). Text the tokenizer has
    # no merges for, which it spells in bytes, comes back whole.
    for text in CORPUS + ["🚀 ṩ ₪ and 𝄞, spelled in bytes"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        sizes = [rng.randint(1, 3) for _ in ids]
        fast, deltas = stream(tokenizer, ids, sizes, FastIncrementalDetokenizer, **kw)
        assert "".join(deltas) == fast.text == tokenizer.decode(ids, **kw)
        # (the trainer makes the <0xNN> tokens special: skipped, they take their bytes along)
        assert fast.text == text or (skip_special_tokens and family == "metaspace")


def test_a_stream_that_refuses_a_token_goes_on_in_python(byte_tokenizer):
    # tokenizers raises when the stream's window breaks; the request then goes on through the
    # Python window from where the stream left off, and no text is lost or doubled.
    class Refuses:
        def __init__(self, stream, after):
            self.stream, self.after = stream, after

        def step(self, backend, token):
            self.after -= 1
            if self.after < 0:
                raise Exception("Invalid prefix encountered")
            return self.stream.step(backend, token)

    ids = byte_tokenizer.encode(TEXT)
    for after in range(len(ids)):
        detok = FastIncrementalDetokenizer(byte_tokenizer)
        detok.stream = Refuses(detok.stream, after)
        deltas = [detok.add([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]
        assert "".join(deltas) == detok.text == TEXT
        assert (detok.stream is None) == (after < len(ids))


def test_the_rust_stream_is_chosen_where_it_gives_the_same_text(byte_tokenizer):
    # vLLM V1's choice: the stream for a tokenizer with a Rust backend, the window otherwise. The
    # stream does not clean up spaces (transformers does that in Python), so a tokenizer that asks
    # for it keeps the window, whose text is tokenizer.decode's.
    from test_engine_loop_bounds import Pieces

    assert type(new_detokenizer(byte_tokenizer)) is FastIncrementalDetokenizer
    assert type(new_detokenizer(Pieces())) is IncrementalDetokenizer
    cleaned = trained("bytelevel")
    cleaned.clean_up_tokenization_spaces = True
    assert type(new_detokenizer(cleaned)) is IncrementalDetokenizer
    ids = cleaned.encode("the cat 's mat .")
    assert new_detokenizer(cleaned).add(ids, finished=True) == cleaned.decode(ids)


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

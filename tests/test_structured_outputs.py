"""Structured outputs (vLLM's structured_outputs): a grammar masks each constrained row of a batch.

Fast tests run a tiny float64 model with a byte tokenizer (one token per byte), so its text is
random but every constrained output must still follow its schema, regex or choice, and every
unconstrained request beside them must give exactly its tokens alone. The embedded model's test
(50+ real requests) is marked slow."""

import json
import re
import threading

import jsonschema
import pytest
import torch
from reference import byte_model

from minicb import Engine, EngineConfig, SamplingParams
from minicb.core.request import RequestStatus
from minicb.model_executor.loader import load_model
from minicb.model_executor.tiny_models import save_tiny_model
from minicb.sampling_params import StructuredOutputsParams as SO
from minicb.structured_output import apply_token_bitmask, bitmask_words
from minicb.structured_output.bitmask import allowed_tokens
from minicb.structured_output.manager import StructuredOutputManager

# Bounded: a random model under the mask still finishes within max_tokens (no free strings, no
# optional whitespace, integers with a range).
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "n"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return byte_model(tmp_path_factory.mktemp("bytes"))


def engine(loaded, **config):
    base = dict(model=loaded.name, dtype="float64", block_size=4, num_blocks=256, max_num_seqs=8)
    return Engine(EngineConfig(**base | config), loaded)


def run(eng, requests) -> dict[str, object]:
    """Add (prompt, params) pairs, run to the end; the finished outputs by request id."""
    ids = [eng.add_request(p, params) for p, params in requests]
    done = {}
    while eng.has_unfinished_requests():
        done |= {o.request_id: o for o in eng.step() if o.finished}
    return [done[i] for i in ids]


def follows(so: SO, text: str) -> bool:
    if so.json is not None:
        jsonschema.validate(json.loads(text), so.json)
        return True
    if so.regex is not None:
        return re.fullmatch(so.regex, text) is not None
    return text in so.choice


def test_exactly_one_constraint_and_clear_errors():
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == SO(regex="a+")
    assert SO(choice=["a", "b"]).choice == ("a", "b") and SO(json_object=True).kind == "json_object"
    for bad, message in [
        ({}, "exactly one of json, regex, choice, grammar and json_object, got none"),
        ({"json": {}, "regex": "a"}, r"got \['json', 'regex'\]"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"choice": []}, "choice must be a list of non-empty strings"),
        ({"schema": {}}, r"unknown structured_outputs fields \['schema'\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(structured_outputs=bad)


def test_the_bitmask_forbids_exactly_its_zero_bits_and_leaves_other_rows_alone():
    vocab = 70  # three words, the last one partly past the vocabulary
    logits = torch.randn(3, vocab, dtype=torch.float64)
    bitmask = torch.zeros(1, bitmask_words(vocab), dtype=torch.int32)
    bitmask[0, 0] = 0b1011  # tokens 0, 1 and 3
    bitmask[0, 2] = 1 << 5  # token 69
    masked = apply_token_bitmask(logits, bitmask, [1])
    allowed = {0, 1, 3, 69}
    assert allowed_tokens(bitmask, vocab)[0].nonzero().flatten().tolist() == sorted(allowed)
    for t in range(vocab):
        expected = logits[1, t] if t in allowed else float("-inf")
        assert masked[1, t] == expected
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])  # bit for bit
    assert apply_token_bitmask(logits, bitmask[:0], []) is logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_constrained_output_follows_its_constraint_and_free_rows_are_unchanged(
    loaded, temperature
):
    constraints = [
        SO(json=SCHEMA, disable_any_whitespace=True),
        SO(regex=REGEX),
        SO(choice=CHOICES),
    ]
    free = SamplingParams(max_tokens=12, temperature=temperature, seed=7, ignore_eos=True)
    requests = [([5 + i, 40, 41], free) for i in range(2)]
    for i, so in enumerate(constraints * 2):
        params = SamplingParams(
            max_tokens=60, temperature=temperature, seed=i, structured_outputs=so
        )
        requests.append(([60 + i, 61, 62, 63], params))
    eng = engine(loaded)
    outs = run(eng, requests)
    assert len(eng.structured._compiled) == 3  # each constraint compiled once, then copied
    for (_, params), out in zip(requests[2:], outs[2:]):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (params.structured_outputs, text)
        assert follows(params.structured_outputs, text), (params.structured_outputs, text)
    alone = run(engine(loaded), requests[:2])  # the free requests, without the constrained ones
    for a, b in zip(alone, outs[:2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_drafts_are_refused_for_constrained_rows_so_the_output_is_the_same(loaded):
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=SO(regex=REGEX))
    prompts = [[70, 71, 72, 70, 71, 72, 70, 71], [48, 49, 50, 45, 97, 98, 48, 49, 50]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    plain = run(engine(loaded), [(p, params) for p in prompts])
    drafted_engine = engine(loaded, speculative_config=spec)
    drafted = run(drafted_engine, [(p, params) for p in prompts])
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in drafted]
    assert all(re.fullmatch(REGEX, o.outputs[0].text) for o in drafted)


def test_n_samples_each_walk_their_own_grammar(loaded):
    params = SamplingParams(
        n=3, max_tokens=60, temperature=1.0, seed=3, structured_outputs=SO(choice=CHOICES)
    )
    (out,) = run(engine(loaded), [([9, 8, 7], params)])
    assert len(out.outputs) == 3 and all(o.text in CHOICES for o in out.outputs)


def test_max_tokens_inside_an_unfinished_structure_finishes_with_length(loaded):
    params = SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=SO(regex=REGEX))
    (out,) = run(engine(loaded), [([3, 4], params)])
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    assert re.fullmatch(r"[0-9]{3}-", out.outputs[0].text)


def test_a_constraint_that_does_not_compile_is_refused_before_anything_changes(loaded):
    eng = engine(loaded)
    for so in (SO(regex="[0-9]{3"), SO(json={"type": "no-such-type"}), SO(grammar="start: (")):
        with pytest.raises(ValueError, match="does not compile"):
            eng.add_request([1, 2], SamplingParams(structured_outputs=so))
    assert not eng.has_unfinished_requests() and not eng.structured.waiting


def test_a_request_waits_for_its_grammar_without_a_slot_and_can_be_aborted(loaded, monkeypatch):
    """vLLM V1's WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR: while its grammar compiles (held here by an
    event), the request is not in the scheduler, holds no block, and a free request runs
    meanwhile."""
    release = threading.Event()
    compile_grammar = StructuredOutputManager._compile

    def slow_compile(self, samples):
        assert release.wait(timeout=30), "the test never released the compiler"
        compile_grammar(self, samples)

    monkeypatch.setattr(StructuredOutputManager, "_compile", slow_compile)
    eng = engine(loaded)
    so = SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=SO(choice=CHOICES))
    waiting = eng.add_request([1, 2, 3], so)
    aborted = eng.add_request([1, 2, 4], so)
    free = eng.add_request([5, 6], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    held = eng.output_processor.samples[waiting][0]
    assert held.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    assert held.grammar is None
    assert (
        waiting not in eng.scheduler.requests
        and waiting not in eng.scheduler.block_manager.block_tables
    )
    assert free not in eng.scheduler.requests  # it ran and finished meanwhile
    out = eng.abort_request(aborted)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    release.set()
    done = {}
    while eng.has_unfinished_requests():
        done |= {o.request_id: o for o in eng.step() if o.finished}
    assert done[waiting].outputs[0].text in CHOICES
    assert (
        done[aborted].outputs[0].finish_reason == "abort"
    )  # reported once more, as the scheduler does
    eng.scheduler.block_manager.check_invariants()


@pytest.mark.slow
def test_fifty_constrained_requests_on_the_embedded_model_parse_and_validate():
    """The issue's test set: 5 schemas, 2 regexes and a choice list, greedy and sampled, on
    SmolLM2-135M-Instruct, with free requests in the same batches."""
    from minicb import LLM  # noqa: PLC0415
    from minicb.engine.llm import chat_token_ids  # noqa: PLC0415

    llm = LLM(max_model_len=1024, max_num_seqs=16)
    tok = llm.get_tokenizer()
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    schemas = [
        person,
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "country": {"type": "string", "maxLength": 40},
            },
            "required": ["city", "country"],
        },
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "maxItems": 4,
                    "items": {"type": "string", "maxLength": 20},
                }
            },
            "required": ["items"],
        },
        {
            "type": "object",
            "properties": {
                "answer": {"enum": ["yes", "no"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["answer", "confidence"],
        },
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 40},
                "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 15},
                    "maxItems": 3,
                },
            },
            "required": ["title", "year"],
        },
    ]
    # no properties beyond the schema's: without that a small model keeps adding keys
    constraints = [SO(json=s | {"additionalProperties": False}) for s in schemas]
    constraints += [SO(regex=r"\d{4}-\d{2}-\d{2}"), SO(regex=r"(red|green|blue) [a-z]{2,8}")]
    constraints += [SO(choice=["positive", "negative", "neutral"])]
    questions = [
        "Describe a person as JSON.",
        "Name a city and its country.",
        "List a few fruits.",
        "Is water wet?",
        "Tell me about a film.",
    ]
    requests = []
    for i in range(56):
        so = constraints[i % len(constraints)]
        temperature = 0.0 if i % 2 == 0 else 0.7
        prompt = chat_token_ids(tok, [{"role": "user", "content": questions[i % 5]}])
        requests.append(
            (
                prompt,
                SamplingParams(
                    max_tokens=200, temperature=temperature, seed=i, structured_outputs=so
                ),
            )
        )
    free = SamplingParams(max_tokens=24, temperature=0.0)
    frees = [(chat_token_ids(tok, [{"role": "user", "content": q}]), free) for q in questions[:3]]
    outs = llm.generate([p for p, _ in requests + frees], [s for _, s in requests + frees])
    for (_, params), out in zip(requests, outs):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert follows(params.structured_outputs, out.outputs[0].text), out.outputs[0].text
    alone = llm.generate([p for p, _ in frees], [s for _, s in frees])
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in outs[-3:]]


def test_the_trace_marks_constrained_rows_and_the_slot_view_draws_them(loaded):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    from minicb import viz  # noqa: PLC0415

    eng = engine(loaded)
    free = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    so = SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=SO(regex=REGEX))
    free_id, so_id = run(eng, [([1, 2], free), ([3, 4], so)])
    rows = [r for s in eng.trace.steps for r in s.rows]
    assert {r.constrained for r in rows if r.request_id == free_id.request_id} == {False}
    assert {r.constrained for r in rows if r.request_id == so_id.request_id} == {True}
    fig = viz.slot_occupancy(eng.trace)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "constrained" in labels


def test_the_tokenizer_is_read_once_in_the_background_and_a_refusal_is_kept(loaded, tmp_path):
    from reference import add_word_tokenizer  # noqa: PLC0415

    from minicb.structured_output import check_structured_outputs, warm_ll_tokenizer  # noqa: PLC0415
    from minicb.structured_output.manager import _LL_TOKENIZERS  # noqa: PLC0415

    warm_ll_tokenizer(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids).join(timeout=60)
    built = _LL_TOKENIZERS[id(loaded.tokenizer)][1]
    check_structured_outputs(SO(regex=REGEX), loaded.tokenizer, 264, loaded.eos_token_ids)
    assert _LL_TOKENIZERS[id(loaded.tokenizer)][1] is built  # not built again
    worded = load_model(add_word_tokenizer(save_tiny_model(tmp_path, seed=1)), torch.float64)
    warm_ll_tokenizer(worded.tokenizer, worded.vocab_size, worded.eos_token_ids).join(timeout=60)
    for _ in range(2):  # llguidance cannot read a WordPiece decoder: refused, from the kept reason
        with pytest.raises(ValueError, match="cannot use this model's tokenizer"):
            check_structured_outputs(SO(regex="a"), worded.tokenizer, 128, worded.eos_token_ids)

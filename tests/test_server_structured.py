"""Structured outputs through the server and the openai client (issue 33): OpenAI's
response_format (json_schema, json_object) on chat, vLLM's structured_outputs on completions,
streamed and not, and a schema that does not compile answered 400 in OpenAI's shape. A tiny
float64 model with a byte tokenizer: its text is random, but it must follow the constraint."""

import json
import re

import jsonschema
import pytest
import torch
from serving import one_torch_thread, serve  # noqa: F401

from minicb.model_executor.loader import load_model
from minicb.model_executor.tiny_models import save_byte_tokenizer, save_tiny_model

openai = pytest.importorskip("openai")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
STREAMED = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytes")
    save_tiny_model(path, vocab_size=264, eos_token_id=256, seed=5, max_position_embeddings=512)
    save_byte_tokenizer(path)
    with serve(load_model(path, dtype=torch.float64), max_model_len=512) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        client.served_model = client.models.list().data[0].id
        yield client


def text_of(response, stream: bool, chat: bool) -> tuple[str, str]:
    """(text, finish_reason) of the first choice, whole or gathered from its chunks."""
    if not stream:
        choice = response.choices[0]
        return (choice.message.content if chat else choice.text), choice.finish_reason
    text, reason = "", None
    for chunk in response:
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            reason = choice.finish_reason or reason
    return text, reason


@STREAMED
def test_chat_with_a_json_schema_response_format(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": SCHEMA, "strict": True}}
    response = client.chat.completions.create(
        model=client.served_model,
        messages=[{"role": "user", "content": "a flag"}],
        max_tokens=80,
        temperature=0.0,
        response_format=fmt,
        stream=stream,
    )
    text, reason = text_of(response, stream, chat=True)
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


@STREAMED
def test_completions_with_vllm_structured_outputs(client, stream):
    response = client.completions.create(
        model=client.served_model,
        prompt="code:",
        max_tokens=40,
        temperature=1.0,
        seed=3,
        stream=stream,
        extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{3}"}},
    )
    text, reason = text_of(response, stream, chat=False)
    assert reason == "stop" and re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text), text
    choice = client.completions.create(
        model=client.served_model,
        prompt="pick:",
        max_tokens=40,
        temperature=0.0,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
    ).choices[0]
    assert choice.text in ("red", "green")


def test_json_object_gives_a_json_object(client):
    response = client.chat.completions.create(
        model=client.served_model,
        messages=[{"role": "user", "content": "{"}],
        max_tokens=120,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    choice = response.choices[0]
    if choice.finish_reason == "stop":  # a random model may still be inside the object at 120
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"structured_outputs": {"regex": "[0-9]{3"}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "wrong"}}},
                    },
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, None),
    ],
)
def test_a_constraint_that_cannot_run_is_a_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=client.served_model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body=extra,
        )
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "invalid_request_error", error
    if param is not None:
        assert error["param"] == param, error

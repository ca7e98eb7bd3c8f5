"""A request's prompts as token ids: tokenized (or rendered by the chat template, then tokenized)
and checked against max_model_len, in a worker thread (app.py calls these with run_in_threadpool),
so that a long prompt costs its own sender and nobody else.

Each prompt's length is checked as soon as it is tokenized, with the engine's own check
(core/limits.py, which runs again when the request is added): a prompt too long for the model
costs its tokenizing only, never the detokenization that echoing it would take.
"""

from ..core.limits import check_request
from ..engine.llm import chat_token_ids
from ..sampling_params import SamplingParams
from .protocol import ChatCompletionRequest
from .responses import Prompt, echoed_prompt
from .validation import APIError


def tokenize_prompts(engine, prompts: list, params: SamplingParams, priority: int, echo: bool):
    """Each prompt's Prompt (with the text and offsets of its echo, if asked), each checked as
    soon as it is tokenized."""
    all_ids = []
    for i, prompt in enumerate(prompts):
        where = f"prompt {i}: " if len(prompts) > 1 else ""
        try:
            ids = engine.tokenize(prompt)
        except ValueError as e:
            raise APIError(400, where + str(e), "prompt") from None
        try:  # the engine's own check (it runs again when the request is added)
            check_request(engine.config, len(ids), params.max_tokens, priority, params.n)
        except ValueError as e:
            raise APIError(400, where + str(e)) from None
        all_ids.append(ids)
    if not echo:
        return [Prompt(ids) for ids in all_ids]
    texts = [p if isinstance(p, str) else None for p in prompts]
    return [echoed_prompt(engine.tokenizer, t, ids) for t, ids in zip(texts, all_ids)]


def tokenize_chat(engine, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    tokenizer = engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            f"model {engine.model_name!r} has no chat template: use /v1/completions",
            "messages",
        )
    try:
        return chat_token_ids(tokenizer, messages)
    # templates may refuse some conversations (e.g. roles that do not alternate)
    except Exception as e:
        raise APIError(400, f"the chat template refused these messages: {e}", "messages") from None


def room_for_reply(engine, num_prompt_tokens: int) -> int:
    """Whatever max_model_len and the KV cache leave a chat reply."""
    c = engine.config
    room = min(
        c.max_model_len - num_prompt_tokens, c.num_blocks * c.block_size - num_prompt_tokens + 1
    )
    if room <= 0:
        raise APIError(
            400,
            f"prompt has {num_prompt_tokens} tokens, which leaves no room for a reply "
            f"(max_model_len is {c.max_model_len})",
            "messages",
        )
    return room

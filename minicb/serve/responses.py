"""Response bodies in OpenAI's formats, built from the engine's RequestOutputs.

One HTTP request is one engine request per prompt, each with n samples; its "choices" are
numbered prompt_index * n + sample_index, as OpenAI numbers them. Choices remembers what each
choice has sent (text, tokens, its finish), so the next chunk of a stream carries only what is new,
and only for the choices that changed; a whole response is the same computed once, at the end.

Log-probabilities come in OpenAI's two shapes, and vLLM's third for its prompt_logprobs field:
  completions  {"tokens", "token_logprobs", "top_logprobs": [{token text: logprob}], "text_offset"}
  chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]} vLLM         [null, {token id: {"logprob", "rank", "decoded_token"}}, ...]  (one per
  prompt token)
JSON has no -inf (a token that a processor forbade), so a logprob is clamped to -9999.0, as vLLM
does. With echo (completions), the text starts with the prompt, and the logprobs with the prompt's
(from the pass that prefilled it; nothing predicts the first prompt token, so its entries are null).
"""

from dataclasses import dataclass, field

from ..engine.detokenizer import new_detokenizer, text_delta

LOGPROB_FLOOR = -9999.0  # what -inf becomes in JSON (vLLM's value)


def clamp(logprob: float) -> float:
    # NaN too: a stream must stay valid JSON
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


class TextOffsets:
    """Where each token's text starts in a text decoded token by token, as the engine decodes its
    outputs (new_detokenizer), counted from `start`. Without a tokenizer every token is at
    `start`."""

    def __init__(self, tokenizer, start: int = 0, skip_special_tokens: bool = True):
        self.start = start
        self.detokenizer = (
            None
            if tokenizer is None
            else new_detokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        )

    def add(self, token_ids: list[int]) -> list[int]:
        offsets = []
        for token in token_ids:
            offsets.append(self.start + len(self.text))
            if self.detokenizer is not None:
                self.detokenizer.add([token])
        return offsets

    @property
    def text(self) -> str:
        return "" if self.detokenizer is None else self.detokenizer.text


@dataclass
class Prompt:
    """One prompt of an HTTP request: its token ids and, when echoed, its text and each token's
    offset."""

    token_ids: list[int]
    echo_text: str = ""
    echo_offsets: list[int] = field(default_factory=list)


def echoed_prompt(tokenizer, text: str | None, token_ids: list[int]) -> Prompt:
    """A prompt to echo: the client's text if it sent text (else the ids decoded), and where each
    token starts in it (exact whenever the tokenizer decodes its own encoding back to the text)."""
    # the prompt as it is, special tokens too
    offsets = TextOffsets(tokenizer, skip_special_tokens=False)
    positions = offsets.add(token_ids)
    if offsets.detokenizer is not None:
        offsets.detokenizer.add([], finished=True)  # a last character held back comes out
    return Prompt(token_ids, offsets.text if text is None else text, positions)


@dataclass
class Sent:
    """What one choice has sent so far."""

    text: str = ""  # generated text (the echoed prompt is not counted)
    num_tokens: int = 0  # generated tokens
    started: bool = False  # its first chunk (with the echo) went out
    finished: bool = False  # its finish_reason went out: nothing more to send
    offsets: TextOffsets | None = None  # where its generated tokens start (completions logprobs)


class Choices:
    """The choices of one HTTP request (its prompts x n samples), in OpenAI's formats.

    chat: the chat format (message or delta), else completions (text). num_logprobs: the top
    alternatives shown per token (None: no logprobs). prompt_only: max_tokens 0 with echo, so
    the one token the engine had to sample is dropped and the reply ends with "length"."""

    def __init__(
        self,
        prompts: list[Prompt],
        tokenizer,
        *,
        chat: bool,
        stream: bool,
        n: int,
        num_logprobs: int | None = None,
        echo: bool = False,
        prompt_only: bool = False,
        prompt_logprobs: bool = False,
    ):
        self.chat, self.stream, self.n, self.prompts, self.tokenizer = (
            chat,
            stream,
            n,
            prompts,
            tokenizer,
        )
        self.num_logprobs, self.echo, self.prompt_only = num_logprobs, echo, prompt_only
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs field was asked for
        self.sent: dict[int, Sent] = {}  # choice index -> what it sent
        self.last: dict[int, object] = {}  # prompt index -> its newest RequestOutput

    def opening(self) -> list[dict]:
        """A chat stream opens with the role, for every choice (as OpenAI's)."""
        return [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(self.n * len(self.prompts))
        ]

    def update(self, prompt_index: int, out) -> list[dict]:
        """The choices of this prompt's newest output that have something new to say."""
        self.last[prompt_index] = out
        bodies = (self._advance(prompt_index, out, sample) for sample in out.outputs)
        return [b for b in bodies if b is not None]

    def _advance(self, prompt_index: int, out, sample) -> dict | None:
        index, prompt = prompt_index * self.n + sample.index, self.prompts[prompt_index]
        sent = self.sent.setdefault(index, Sent())
        finished = sample.finish_reason is not None
        if sent.finished:
            return None
        echo_now = self.echo and not sent.started
        if self.prompt_only:
            token_ids, text = [], ""
        else:
            token_ids, text = (
                sample.token_ids[sent.num_tokens :],
                text_delta(sent.text, sample.text, finished),
            )
        if not (token_ids or text or finished or echo_now):
            return None  # a sample that got nothing this step
        if not self.chat:
            body = {"index": index, "text": (prompt.echo_text if echo_now else "") + text}
        elif self.stream:  # a finishing chunk may carry no text
            body = {"index": index, "delta": {"content": text} if text or not finished else {}}
        else:
            body = {"index": index, "message": {"role": "assistant", "content": text}}
        body["logprobs"] = None
        if self.num_logprobs is not None:
            new = (
                []
                if sample.logprobs is None
                else sample.logprobs[sent.num_tokens : sent.num_tokens + len(token_ids)]
            )
            body["logprobs"] = (
                self._chat_logprobs(token_ids, new)
                if self.chat
                else self._completion_logprobs(out, sample, prompt, sent, token_ids, new, echo_now)
            )
        body["finish_reason"] = (
            ("length" if self.prompt_only else sample.finish_reason) if finished else None
        )
        body["token_ids"] = token_ids
        if self.prompt_logprobs and not self.chat:
            body["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs)
        sent.text, sent.num_tokens = sent.text + text, sent.num_tokens + len(token_ids)
        sent.started, sent.finished = True, finished
        return body

    # ------------------------------------------------------------------ logprobs
    def _token_text(self, token: int, entry: dict | None) -> str:
        lp = None if entry is None else entry.get(token)
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        # vLLM's spelling
        return f"token_id:{token}" if self.tokenizer is None else self.tokenizer.decode([token])

    def _top(self, entry: dict, chosen: int, k: int, with_chosen: bool) -> list[tuple[str, float]]:
        """(text, logprob) of the k most likely tokens, best first, and of the chosen one if
        asked."""
        ranked = sorted(entry.items(), key=lambda item: (item[1].rank is None, item[1].rank or 0))
        return [
            (self._token_text(t, entry), clamp(lp.logprob))
            for t, lp in ranked
            if (with_chosen and t == chosen) or (lp.rank is not None and lp.rank <= k)
        ]

    def _completion_logprobs(
        self, out, sample, prompt: Prompt, sent: Sent, token_ids, new, echo_now
    ) -> dict:
        rows, offsets = [], []  # (token, its entry or None)
        if echo_now:
            entries = list(out.prompt_logprobs or [])
            rows += [
                (t, entries[i] if i < len(entries) else None)
                for i, t in enumerate(prompt.token_ids)
            ]
            offsets += prompt.echo_offsets
        rows += list(zip(token_ids, new))
        if sent.offsets is None:
            sent.offsets = TextOffsets(
                self.tokenizer, start=len(prompt.echo_text) if self.echo else 0
            )
        generated = sent.offsets.add(token_ids)
        if sample.finish_reason is not None:  # a stop string may have cut the text before a token
            end = (len(prompt.echo_text) if self.echo else 0) + len(sample.text)
            generated = [min(o, end) for o in generated]
        top = [
            None if e is None else best_per_text(self._top(e, t, self.num_logprobs, True))
            for t, e in rows
        ]
        return {
            "tokens": [self._token_text(t, e) for t, e in rows],
            "token_logprobs": [None if e is None else clamp(e[t].logprob) for t, e in rows],
            "top_logprobs": top,
            "text_offset": offsets + generated,
        }

    def _chat_logprobs(self, token_ids, new) -> dict:
        content = []
        for token, entry in zip(token_ids, new):
            text = self._token_text(token, entry)
            top = [
                {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}
                for s, lp in self._top(entry, token, self.num_logprobs, False)
            ]
            content.append(
                {
                    "token": text,
                    "logprob": clamp(entry[token].logprob),
                    "bytes": list(text.encode("utf-8", "replace")),
                    "top_logprobs": top,
                }
            )
        return {"content": content}

    # ------------------------------------------------------------------ whole responses
    def whole(self, outputs: dict[int, object]) -> list[dict]:
        """Every choice, complete, from each prompt's last output (a response that is not
        streamed)."""
        choices = [c for i, out in sorted(outputs.items()) for c in self.update(i, out)]
        return sorted(choices, key=lambda c: c["index"])

    def usage(self) -> dict:
        """Token counts over every prompt (each counted once) and every sample."""
        n_in = sum(len(p.token_ids) for p in self.prompts)
        n_out = (
            0
            if self.prompt_only
            else sum(len(s.token_ids) for o in self.last.values() for s in o.outputs)
        )
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def best_per_text(ranked: list[tuple[str, float]]) -> dict[str, float]:
    """{text: logprob}, best first. Tokens can share a text (pieces of one UTF-8 character all read
    U+FFFD): keep the best, so that "is the chosen token's logprob the top one?" stays a fair
    test."""
    top = {}
    for text, logprob in ranked:
        top.setdefault(text, logprob)
    return top


def vllm_prompt_logprobs(entries: list | None) -> list | None:
    """vLLM's prompt_logprobs in JSON: per prompt token, {token id: {logprob, rank,
    decoded_token}}."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(t): {
                "logprob": clamp(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for t, lp in e.items()
        }
        for e in entries
    ]

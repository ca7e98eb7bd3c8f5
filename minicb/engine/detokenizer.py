"""Incremental detokenization: a request's text grows by decoding a few new tokens, not all of them.

Decoding the whole output again at every step costs O(length) per token, O(length^2) per request,
and a server pays it for every stream in the batch. Decoding only the newest token does not work
either: a token's text can depend on its neighbours (SentencePiece drops a word's leading space at
the start of a string; byte-level BPE splits one multi-byte character over several tokens, whose
pieces decode to U+FFFD until the last one arrives). So, as vLLM's incremental detokenizer does,
keep a small window of tokens: decode the window with and without the new tokens, and emit the
difference once it no longer ends in U+FFFD (the character is complete). The window then starts
where the emitted text ended. Every delta is appended, so the concatenated stream is the text.

Stop strings (SamplingParams.stop) are looked for in the text, where they can span tokens: only
those that end in the new text (vLLM's rule), so the work of a token never grows with the text. Nor
does it grow with the number of stop strings: they are kept in one set per length (StopStrings),
so a token costs one set lookup per new character and distinct length, whether the request gave 4
stop strings or 700,000. The text is cut before the string (or after it, with
include_stop_str_in_output). While the request runs, a stream is shown all but the last
len(longest stop string) - 1 characters (visible_text), so it never shows the start of a stop
string that the next token completes and the cut then removes. (vLLM does the same.)

Two ways to find a token's new text, as in vLLM V1 (vllm/v1/engine/detokenizer.py):
- IncrementalDetokenizer: the window above, two decodes through the tokenizer's Python API per
  token (vLLM V0's detokenize_incrementally; V1 keeps it as SlowIncrementalDetokenizer, for
  tokenizers that have no Rust backend). About 12-15 us a token for SmolLM2 on a Xeon.
- FastIncrementalDetokenizer: the same window kept inside the Rust tokenizers library
  (tokenizers.decoders.DecodeStream), one call per token: about 2 us. V1 uses it for every
  tokenizer that has a Rust backend; new_detokenizer() picks it likewise. A server detokenizes
  every token of every stream in its API process, so this is per-token work taken from the cores
  the engine runs on.
Fed one token at a time, both give the same pieces, and for text the model could have written they
add up to the output's decode at once. (Not for a run of byte-fallback tokens <0xNN> that is not
UTF-8: its decode depends on what follows, in vLLM too. vLLM also primes the stream with the
prompt's ids, which changes the first token's text for a tokenizer whose decoder drops a leading
space; minicb's text is the output's own decode, as transformers' is.)
"""

import itertools

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"  # what a decoder gives for the bytes of an unfinished character


class StopStrings:
    """A request's stop strings, one set per length: finding those that end in new text costs a set
    lookup per (new character, distinct length), never a search per string. Built once per request
    and shared by its samples."""

    def __init__(self, stop: tuple[str, ...] = ()):
        # length -> the stop strings of that length, shortest first (a sort and one pass)
        by_length = itertools.groupby(sorted(stop, key=len), key=len)
        self.by_length = {length: frozenset(strings) for length, strings in by_length}
        self.longest = max(self.by_length, default=0)

    def __bool__(self) -> bool:
        return bool(self.by_length)

    def find(self, text: str, start: int, ends_from: int) -> tuple[int, str] | None:
        """(position, string) of the earliest stop string in `text` that starts at `start` or later
        and whose last character is at `ends_from` or later; None if there is none. Of two that
        start at the same place, the shorter (the other begins with it, so it is also the smaller
        string, as min() over every string's first occurrence would pick)."""
        found = None
        for length, strings in self.by_length.items():
            first = max(start, ends_from - length + 1)
            for i in range(first, len(text) - length + 1):
                if found is not None and i >= found[0]:
                    break  # an earlier (or as early and shorter) one is found already
                if text[i : i + length] in strings:
                    found = (i, text[i : i + length])
                    break
        return found


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        stop: "tuple[str, ...] | StopStrings" = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # a request's samples share one StopStrings (OutputProcessor builds it)
        self.stop = stop if isinstance(stop, StopStrings) else StopStrings(tuple(stop))
        self.include_stop = include_stop_str_in_output
        # characters that may start a stop string
        self.hold_back = max(self.stop.longest, 1) - 1
        self.stop_reason: str | None = None  # the stop string found, once found
        # Stop strings that end before this position were looked for already. None until the first
        # search, which also looks at the held-back tail before the new text (while min_tokens
        # held the search back, that tail was never searched).
        self.searched_to: int | None = None
        # no stop string is looked for until more tokens than this are out (vLLM)
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []  # every output token seen so far
        self.prefix_offset = 0  # the window starts here: context for the tokens not yet emitted
        self.read_offset = 0  # tokens before this one have had their text emitted
        self.text = ""  # the text emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Take the step's new tokens; return the text they complete ("" while a character is
        partial). With `finished`, whatever is held back comes out, complete or not."""
        delta = self._new_text(new_token_ids, finished)
        if not delta:
            return ""
        self.text += delta
        if self.stop and self.stop_reason is None and len(self.token_ids) > self.min_tokens:
            self._find_stop(len(self.text) - len(delta))
        return delta

    def _new_text(self, new_token_ids: list[int], finished: bool) -> str:
        """The window: decode it with and without the new tokens; the difference is new text."""
        self.token_ids += new_token_ids
        before = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT_CHAR) and not finished):
            return ""  # nothing new yet, or half of a character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return after[len(before) :]

    def _find_stop(self, new_from: int) -> None:
        start = max(0, new_from - self.hold_back)  # a stop string may begin in the held-back tail
        ends_from = start if self.searched_to is None else self.searched_to
        self.searched_to = len(self.text)
        found = self.stop.find(self.text, start, ends_from)
        if found is not None:
            i, s = found
            self.text = self.text[: i + len(s) if self.include_stop else i]
            self.stop_reason = s

    def visible_text(self, finished: bool) -> str:
        """What a client may see: all the text once finished, else all but the held-back tail."""
        if finished or self.stop_reason is not None or not self.hold_back:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold_back)]


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """The window kept by tokenizers' DecodeStream, in Rust: one call per token (vLLM V1's
    FastIncrementalDetokenizer). The offsets mirror the stream's window, so two rare cases go
    through the Python window instead: a finished request's held-back bytes (the stream never
    emits half a character; IncrementalDetokenizer's rule flushes it as U+FFFD), and a stream
    that refuses a token (tokenizers raises when the window's text stops being a prefix of the
    longer decode; vLLM then restarts the stream, here the request goes on in Python)."""

    def __init__(self, tokenizer, *args, **kwargs):
        super().__init__(tokenizer, *args, **kwargs)
        self.backend = tokenizer.backend_tokenizer  # the Rust tokenizers.Tokenizer
        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def _new_text(self, new_token_ids: list[int], finished: bool) -> str:
        pieces = [self._step(token) for token in new_token_ids]
        if finished and self.read_offset < len(self.token_ids):
            pieces.append(super()._new_text([], True))  # the held-back bytes, as U+FFFD
        return "".join(pieces)

    def _step(self, token: int) -> str:
        """One token through the stream, or through the window once the stream has failed."""
        if self.stream is not None:
            try:
                piece = self.stream.step(self.backend, token)
            except Exception:  # the stream's window broke: the window in Python from here on
                self.stream = None
            else:
                self.token_ids.append(token)
                if piece is None:  # half of a character: the stream holds it back
                    return ""
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
                return piece
        return super()._new_text([token], False)


def new_detokenizer(tokenizer, *args, **kwargs) -> IncrementalDetokenizer:
    """The detokenizer for a request (arguments: IncrementalDetokenizer's): the Rust stream when
    the tokenizer has a Rust backend, as vLLM V1's IncrementalDetokenizer.from_new_request picks.
    A tokenizer that cleans up spaces after decoding (clean_up_tokenization_spaces, done by
    transformers in Python, not by the stream) keeps the Python window, so that the text stays
    what tokenizer.decode gives."""
    fast = isinstance(getattr(tokenizer, "backend_tokenizer", None), Tokenizer) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    )
    return (FastIncrementalDetokenizer if fast else IncrementalDetokenizer)(
        tokenizer, *args, **kwargs
    )


def text_delta(sent: str, text: str, finished: bool) -> str:
    """New text since `sent` (for streaming the growth of a decoded output). A trailing U+FFFD is
    half of a multi-byte character: hold it back."""
    if not finished:
        text = text.rstrip("\ufffd")
    return text[len(sent) :] if text.startswith(sent) else ""

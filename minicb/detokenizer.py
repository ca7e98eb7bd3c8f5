"""Incremental detokenization: a request's text grows by decoding a few new tokens, not all of them.

Decoding the whole output again at every step costs O(length) per token, O(length^2) per request,
and a server pays it for every stream in the batch. Decoding only the newest token does not work
either: a token's text can depend on its neighbours (SentencePiece drops a word's leading space at
the start of a string; byte-level BPE splits one multi-byte character over several tokens, whose
pieces decode to U+FFFD until the last one arrives). So, as vLLM's incremental detokenizer does,
keep a small window of tokens: decode the window with and without the new tokens, and emit the
difference once it no longer ends in U+FFFD (the character is complete). The window then starts
where the emitted text ended. Every delta is appended, so the concatenated stream is the text.
"""

REPLACEMENT_CHAR = "\ufffd"  # what a decoder gives for the bytes of an unfinished character


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []  # every output token seen so far
        self.prefix_offset = 0  # the window starts here: context for the tokens not yet emitted
        self.read_offset = 0  # tokens before this one have had their text emitted
        self.text = ""  # the text emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Take the step's new tokens; return the text they complete ("" while a character is partial).
        With `finished`, whatever is held back comes out, complete or not."""
        self.token_ids += new_token_ids
        before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset:])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT_CHAR) and not finished):
            return ""  # nothing new yet, or half of a character: wait for the next token
        delta = after[len(before):]
        self.text += delta
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return delta

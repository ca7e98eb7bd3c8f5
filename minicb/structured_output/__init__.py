"""Structured outputs: the output follows a JSON schema, a regex, a list of choices or a grammar.

How one constrained request rides in a batch of hundreds (vLLM V1's v1/structured_output/):

1. **Compile, off the step loop.** The request's constraint (`SamplingParams.structured_outputs`)
   becomes a grammar, and the grammar a matcher: a parser that knows, after any prefix of tokens,
   which tokens may come next. Compiling takes from microseconds to seconds, so it runs in a worker
   thread; until it is done the request waits outside the scheduler, holding no slot and no block
   (vLLM V1's WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR). Compiled grammars are cached: the next request
   with the same schema starts from a copy.
2. **Mask, before sampling.** Every step, each constrained row of the batch gets a bitmask over the
   vocabulary (one bit per token: 49,152 bits, 6 KiB, for SmolLM2), computed on the CPU by its
   matcher; the sampler sets the logits of forbidden tokens to -inf and then samples as usual, so
   temperature, top-p and the rest act on the allowed tokens only. Unconstrained rows are not
   touched. A mask cannot be applied after sampling: a token drawn from the unmasked distribution
   and then refused leaves nothing to fall back on but a second draw from a distribution the
   sampler never saw.
3. **Advance, after sampling.** Each accepted token moves the row's matcher forward. When the
   grammar is complete, its mask allows only end-of-sequence, and the request stops there.

The grammar engine is llguidance (guidance-ai; vLLM's "guidance" backend, also used by llama.cpp
and SGLang), a Rust library: minicb writes none of the parsing, only where it sits in the step.
Requests with speculative drafts are not constrained drafts: a constrained request proposes none
(spec_decode.ngram_proposer.can_speculate), so its output is the same with drafts on or off.
"""

from .bitmask import apply_token_bitmask, bitmask_words
from .manager import (
    GrammarError,
    RequestGrammar,
    StructuredOutputManager,
    apply_grammars,
    check_structured_outputs,
    grammar_text,
    warm_ll_tokenizer,
)

__all__ = [
    "GrammarError",
    "RequestGrammar",
    "StructuredOutputManager",
    "apply_grammars",
    "apply_token_bitmask",
    "bitmask_words",
    "check_structured_outputs",
    "grammar_text",
    "warm_ll_tokenizer",
]

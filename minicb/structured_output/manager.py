"""Compiling constraints to matchers, off the step loop, and the matcher each constrained sample
carries (see __init__.py for where they sit in a step)."""

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from ..core.request import Request, RequestStatus
from ..structured_outputs_params import StructuredOutputsParams
from .bitmask import apply_token_bitmask, bitmask_words

CACHED_GRAMMARS = 64  # compiled grammars kept, least recently used dropped first
_LL_LOCK = threading.Lock()  # one build per tokenizer, and the caches below


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile (the server answers 400)."""


_CHECKED: OrderedDict[str, str] = OrderedDict()  # a constraint's canonical form -> its grammar


def grammar_text(so: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (text). Raises GrammarError if it does not
    compile. A constraint checked before (a server checks it for the 400, then again when it makes
    the request) is not checked again."""
    key = json.dumps(
        [so.kind, getattr(so, so.kind), so.disable_any_whitespace], sort_keys=True, default=repr
    )
    with _LL_LOCK:
        if key in _CHECKED:
            _CHECKED.move_to_end(key)
            return _CHECKED[key]
    text = _compile_text(so)
    with _LL_LOCK:
        _CHECKED[key] = text
        if len(_CHECKED) > CACHED_GRAMMARS:
            _CHECKED.popitem(last=False)
    return text


def _compile_text(so: StructuredOutputsParams) -> str:
    import llguidance  # noqa: PLC0415 (only a constrained request needs it)

    matcher = llguidance.LLMatcher
    kind = so.kind
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else so.json
            schema = json.loads(schema) if isinstance(schema, str) else schema
            flexible = {"whitespace_flexible": not so.disable_any_whitespace}
            text = matcher.grammar_from_json_schema(schema, overrides=flexible)
        elif kind == "regex":
            text = matcher.grammar_from_regex(so.regex)
        elif kind == "choice":
            text = llguidance.grammar_from("choice", json.dumps(list(so.choice)))
        else:  # a Lark grammar as llguidance reads it, or GBNF (converted)
            text = llguidance.grammar_from("grammar", so.grammar)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"structured_outputs.{kind} does not compile: {e}") from None
    error = matcher.validate_grammar(text)
    if error:
        raise GrammarError(f"structured_outputs.{kind} does not compile: {error.strip()}")
    return text


def check_structured_outputs(
    so: StructuredOutputsParams | None, tokenizer, vocab_size: int, eos_token_ids
) -> None:
    """Refuse, naming the problem, a constraint that cannot run with this tokenizer (before the
    request is queued: a server answers 400)."""
    if so is None:
        return
    grammar_text(so)
    ll_tokenizer(tokenizer, vocab_size, eos_token_ids)


# id(tokenizer) -> (tokenizer, its llguidance tokenizer or None, why llguidance cannot read it)
_LL_TOKENIZERS: dict[int, tuple] = {}


def ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids):
    """The tokenizer as llguidance sees it (each token's bytes, the EOS ids), built once per
    tokenizer (~1 s for a 49k vocabulary). ValueError if there is none llguidance can read."""
    if tokenizer is None or not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "structured_outputs needs the model's fast (Hugging Face tokenizers) tokenizer; "
            "this model has none"
        )
    with _LL_LOCK:
        kept = _LL_TOKENIZERS.get(id(tokenizer))
        if kept is None or kept[0] is not tokenizer:
            import llguidance.hf  # noqa: PLC0415

            try:
                built = llguidance.hf.from_tokenizer(
                    tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
                )
                kept = (tokenizer, built, None)
            except Exception as e:  # the grammar engine cannot read this tokenizer
                kept = (
                    tokenizer,
                    None,
                    f"structured_outputs cannot use this model's tokenizer: {e}",
                )
            _LL_TOKENIZERS[id(tokenizer)] = kept
    if kept[2] is not None:
        raise ValueError(kept[2])
    return kept[1]


def warm_ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids) -> threading.Thread | None:
    """Build llguidance's view of the tokenizer in a background thread, so that the first
    constrained request does not (a server calls it as it starts: its requests are checked on the
    engine loop's thread)."""
    if getattr(tokenizer, "is_fast", False):
        args = (tokenizer, vocab_size, eos_token_ids)
        thread = threading.Thread(target=_quietly, args=args, daemon=True, name="minicb-llg")
        thread.start()
        return thread
    return None


def _quietly(*args) -> None:
    try:
        ll_tokenizer(*args)
    except ValueError:  # kept: the first constrained request gets it as a 400
        pass


class RequestGrammar:
    """One sample's matcher: the tokens it may take next, advanced with every token it takes."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.num_tokens = 0  # tokens accepted so far

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] ((rows, words) int32, CPU)."""
        target = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance past one sampled token; False if the grammar refuses it."""
        self.num_tokens += 1
        return self.matcher.consume_token(token_id)

    def is_finished(self) -> bool:
        """Complete: nothing but end-of-sequence may follow (or the matcher failed)."""
        return self.matcher.is_stopped()

    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces from here, whatever the model says (jump-ahead)."""
        return self.matcher.compute_ff_tokens()


def finish(samples: list[Request], status: RequestStatus) -> Request:
    """Finish a request that never reached the scheduler; returns it (its first sample)."""
    for sample in samples:
        sample.status = status
        sample.metrics.finish_time = time.perf_counter()
    return samples[0]


def apply_grammars(logits: torch.Tensor, seqs: list[Request]) -> torch.Tensor:
    """The step's logits with each constrained row's forbidden tokens at -inf: one bitmask row per
    constrained sequence, filled on the CPU by its matcher, applied in one masked fill. Rows
    without a grammar are returned exactly as they were."""
    constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not constrained:
        return logits
    bitmask = torch.empty(len(constrained), bitmask_words(logits.shape[1]), dtype=torch.int32)
    for row, i in enumerate(constrained):
        seqs[i].grammar.fill_bitmask(bitmask, row)
    return apply_token_bitmask(logits, bitmask, constrained)


class StructuredOutputManager:
    """Compiles each constrained request's grammar in a worker thread, holds the request until it is
    ready (vLLM V1's WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR: no slot, no block), hands every sample a
    matcher of its own, and advances the matchers with the tokens sampled (vLLM V1's
    StructuredOutputManager)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._compiled: OrderedDict[str, object] = OrderedDict()  # grammar text -> a fresh matcher
        self._pool = None
        self.waiting: list[tuple[list[Request], Future]] = []  # requests whose grammar compiles

    # ------------------------------------------------------------------ before the scheduler
    def hold(self, samples: list[Request]) -> None:
        """Start compiling a request's grammar; it waits here until take_ready() hands it over."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minicb-grammar")
        for sample in samples:
            sample.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        self.waiting.append((samples, self._pool.submit(self._compile, samples)))

    def queue_ready(self, scheduler) -> None:
        """Hand the requests whose grammar is ready to the scheduler; those whose grammar failed
        (or that the scheduler refuses) finish at once, `error` set, in scheduler.finished. With
        nothing else to run it waits a little for a grammar rather than spin."""
        if self.waiting and not scheduler.requests:
            wait([f for _, f in self.waiting], timeout=0.05, return_when=FIRST_COMPLETED)
        done = [(s, f) for s, f in self.waiting if f.done()]
        self.waiting = [(s, f) for s, f in self.waiting if not f.done()]
        for samples, future in done:
            for sample in samples:
                sample.status = RequestStatus.WAITING
            try:
                future.result()
                scheduler.add_request(samples[0])
            except ValueError as e:  # GrammarError too
                samples[0].error = f"{type(e).__name__}: {e}"
                scheduler.finished.append(finish(samples, RequestStatus.FINISHED_ERROR))

    def drop(self, samples: list[Request], scheduler) -> bool:
        """Abort a held request (its grammar not ready yet: it holds nothing), reported in
        scheduler.finished. False if it is not held here."""
        if all(s is not samples for s, _ in self.waiting):
            return False
        self.waiting = [(s, f) for s, f in self.waiting if s is not samples]
        scheduler.finished.append(finish(samples, RequestStatus.FINISHED_ABORTED))
        return True

    # ------------------------------------------------------------------ after a step
    def advance(self, touched: list[Request], scheduler) -> list[tuple[Request, str]]:
        """Move each constrained sample's matcher past the tokens it took this step. Returns the
        samples whose grammar refused a token, with why. A sample whose grammar is complete while
        it ignores EOS stops here: nothing may follow."""
        refused = []
        for req in touched:
            if req.grammar is None or req.status == RequestStatus.FINISHED_ERROR:
                continue
            new = req.token_ids[req.num_tokens - req.num_new_tokens :]
            bad = next((t for t in new if not req.grammar.accept(t)), None)
            if bad is not None:
                refused.append((req, f"its grammar refused token {bad}: {req.grammar.error()}"))
            elif req.grammar.is_finished() and req.params.ignore_eos and not req.is_finished:
                scheduler.abort_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        return refused

    # ------------------------------------------------------------------ compiling
    def _compile(self, samples: list[Request]) -> None:
        grammar = self.new_grammar(samples[0].params.structured_outputs)
        samples[0].grammar = grammar
        for sample in samples[1:]:  # each sample walks its own copy
            sample.grammar = RequestGrammar(grammar.matcher.deep_copy())

    def new_grammar(self, so: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for a constraint, compiled here and now (a copy of the cached one when
        the same grammar was compiled before). Raises GrammarError if it does not compile."""
        text = grammar_text(so)
        template = self._compiled.get(text)
        if template is None:
            import llguidance  # noqa: PLC0415

            tokenizer = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            template = llguidance.LLMatcher(tokenizer, text, log_level=0)
            if template.is_error():
                raise GrammarError(f"the grammar does not compile: {template.get_error()}")
            self._compiled[text] = template
            if len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(text)
        return RequestGrammar(template.deep_copy())

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

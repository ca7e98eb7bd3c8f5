"""Beam search inside the continuous batch: vLLM's `LLM.beam_search`, on rows that fork and share
their KV blocks.

Beam search keeps, for each prompt, the `beam_width` likeliest continuations found so far (beams).
Each round every beam proposes its 2 * beam_width likeliest next tokens (enough that beam_width are
left when some are EOS), each candidate is scored by the log-probability of its whole sequence, and
the best beam_width survive. Here every beam is a row of the engine's batch, beside other requests:
  - the prompt is admitted with beam_width seats, as an n-sample request is; after its prefill the
    other seats fork from it (Scheduler.fork) and share its blocks;
  - once all of a prompt's beams have sampled, the candidates (the rows' 2 * beam_width logprobs)
    are ranked. A beam with one surviving child continues in place: its new token is not in the
    cache yet, so the child's takes its place. A beam with k children forks k - 1 rows that share
    its blocks by reference count (BlockManager.fork); the partly filled last block is copied on the
    first write (copy_on_write). A beam with no child is aborted at once: the blocks it alone held
    are free before the next step is scheduled (the trace lists it among that step's finished);
  - a round waits for all of a prompt's beams. If one was held back (preempted, or out of token
    budget), those that already sampled leave the batch, so that none runs ahead, and their children
    come back as waiting requests that find their full blocks in the prefix cache.
vLLM V1 runs each round as new one-token requests that meet in the prefix cache; V0 forked sequences
inside a sequence group, as this file forks rows.

Ranking, as vLLM's (vllm/beam_search.py, get_beam_search_score): the live beams are the beam_width
non-EOS candidates of highest cumulative log-probability. A candidate whose token is EOS (unless
ignore_eos) finishes with "stop" at once, whatever its rank among its beam's candidates. After
max_tokens rounds the live beams finish with "length" (vLLM leaves None), and the finished beams are
ranked by cum_logprob / length ** length_penalty, length counting the prompt and the generated
tokens but a final EOS. transformers' generate(num_beams=...) divides by the generated length only,
keeps an EOS candidate only among the step's top num_beams and at most num_beams finished beams, and
may stop early (early_stopping). While no beam ends early both return the same beams in the same
order: the best beam_width continuations of all beams are each among their own beam's top
2 * beam_width, and beams of equal length rank by their cumulative log-probability alone.
"""

import math
from dataclasses import dataclass, field

from ..core.request import Request, RequestStatus
from ..outputs import Logprob
from ..sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams, validated on construction."""

    beam_width: int  # beams kept per prompt; each ranks its 2 * beam_width likeliest next tokens
    max_tokens: int  # rounds of the search: tokens generated per beam at most
    ignore_eos: bool = False  # EOS is a token like any other: no beam finishes before max_tokens
    # 0: each beam's candidates are its top 2 * beam_width tokens; > 0 adds the one its row samples
    temperature: float = 0.0
    # finished beams are ranked by cum_logprob / length ** length_penalty (vLLM's rule, above)
    length_penalty: float = 1.0

    def __post_init__(self):
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
        is_number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
        widest = MAX_LOGPROBS // 2
        self._require(
            "beam_width",
            is_int(self.beam_width) and 1 <= self.beam_width <= widest,
            f"an integer in [1, {widest}] (each beam ranks its 2 * beam_width likeliest tokens, "
            f"and logprobs are limited to {MAX_LOGPROBS})",
        )
        self._require(
            "max_tokens", is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"
        )
        self._require("ignore_eos", isinstance(self.ignore_eos, bool), "True or False")
        self._require(
            "temperature",
            is_number(self.temperature) and 0 <= self.temperature < math.inf,
            "a finite number >= 0",
        )
        self._require(
            "length_penalty",
            is_number(self.length_penalty) and math.isfinite(self.length_penalty),
            "a finite number",
        )

    def _require(self, name: str, ok: bool, expected: str) -> None:
        if not ok:
            raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")


@dataclass
class BeamSearchSequence:
    """One beam as a user gets it back (vLLM's name and fields)."""

    tokens: list[int]  # the prompt's tokens, then the generated ones (as vLLM's)
    logprobs: list[dict[int, Logprob]]  # per generated token: the candidates its beam ranked
    cum_logprob: float = 0.0  # the generated tokens' log-probabilities, summed
    text: str | None = None  # `tokens` decoded, prompt included (as vLLM's), given a tokenizer
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_tokens) or "abort"
    stop_reason: int | None = None  # the EOS token that ended it


@dataclass
class BeamSearchOutput:
    """The best beam_width beams of one prompt, best first (vLLM's name)."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: list[int], cumulative_logprob: float, eos_token_ids, length_penalty: float = 1.0
) -> float:
    """vLLM's score of a finished beam: cum_logprob / length ** length_penalty, the length counting
    the prompt and every generated token but a final EOS (vLLM takes one EOS id; minicb a set)."""
    seq_len = len(tokens)
    if tokens[-1] in eos_token_ids:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


@dataclass(eq=False)
class Beam:
    """A live beam: its sequence so far and the row of the batch that extends it."""

    tokens: list[int]  # prompt + generated; the newest is the row's next input
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    row: Request | None = None  # None once it left the batch (its round's candidates are in)
    candidates: dict[int, Logprob] | None = None  # {token: Logprob} its row found this round
    parent: "Beam | None" = field(default=None, repr=False)

    def child(self, token: int) -> "Beam":
        entry = self.candidates
        return Beam(
            self.tokens + [token],
            self.logprobs + [entry],
            self.cum_logprob + entry[token].logprob,
            parent=self,
        )

    def finished(self, reason: str, stop_reason: int | None = None) -> BeamSearchSequence:
        return BeamSearchSequence(
            self.tokens, self.logprobs, self.cum_logprob, None, reason, stop_reason
        )


class BeamSearchInstance:
    """One prompt's search (vLLM's name): its live beams and the beams that finished."""

    def __init__(self, request_id: str, first_row: Request, spare_rows: list[Request]):
        self.request_id = request_id  # the first row's id; other rows are "<k>_<request_id>"
        self.prompt_token_ids = first_row.prompt_token_ids
        self.arrival_index = first_row.arrival_index  # its rows are served in its arrival order
        self.beams = [Beam(list(self.prompt_token_ids), [], 0.0, row=first_row)]
        # the seats reserved at admission, forked after the prefill: round 1's children take them
        self.spares = spare_rows
        self.num_rows = 1 + len(spare_rows)  # rows made so far (names the next)
        self.completed: list[BeamSearchSequence] = []
        self.finished = False

    def __repr__(self):
        rows = [b.row.request_id if b.row else None for b in self.beams]
        return (
            f"BeamSearchInstance({self.request_id!r}, beams={len(self.beams)} rows={rows}, "
            f"completed={len(self.completed)}, finished={self.finished})"
        )


class BeamSearch:
    """Beam searches run through an Engine: add() each prompt, then call update() after every
    engine.step() until `finished`; output() gives each prompt's BeamSearchOutput. Other requests
    may share the engine (and its steps) all along."""

    def __init__(self, engine, params: BeamSearchParams):
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        width, slots = params.beam_width, engine.config.max_num_seqs
        if width > slots:
            raise ValueError(
                f"beam_width={width} needs {width} slots (one row per beam), but max_num_seqs is "
                f"{slots}"
            )
        self.engine = engine
        self.scheduler = engine.scheduler
        self.params = params
        # The rows sample one token and report their 2 * beam_width likeliest: the driver, not the
        # scheduler, decides what an EOS means, so the rows ignore it.
        self.first_row_params = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            logprobs=2 * width,
            ignore_eos=True,
            n=width,
        )
        self.row_params = self.first_row_params.for_sample(0)
        self.eos_token_ids = frozenset() if params.ignore_eos else engine.eos_token_ids
        self.instances: list[BeamSearchInstance] = []

    @property
    def finished(self) -> bool:
        return all(inst.finished for inst in self.instances)

    def add(self, prompt: str | list[int]) -> BeamSearchInstance:
        """Queue a prompt (text or token ids); raises ValueError, changing nothing, if it can never
        run."""
        request_id = self.engine.add_request(prompt, self.first_row_params)
        rows = self.engine.output_processor.samples[request_id]
        for row in rows:
            self._without_text(row)
        inst = BeamSearchInstance(request_id, rows[0], rows[1:])
        self.instances.append(inst)
        return inst

    def update(self) -> None:
        """After a step: take the candidates of the rows that sampled, then rank every prompt whose
        beams all have theirs; a prompt still waiting for some lets the others leave the batch."""
        for inst in self.instances:
            if inst.finished or not self._collect(inst):
                continue
            if all(beam.candidates is not None for beam in inst.beams):
                self._prune(inst)
                continue
            for beam in inst.beams:
                if beam.candidates is not None and beam.row is not None:
                    self._drop(beam.row)  # it must not run ahead: its children will be resubmitted
                    beam.row = None

    def output(self, inst: BeamSearchInstance) -> BeamSearchOutput:
        """The best beam_width finished beams of a prompt, best first, their text decoded."""
        best = sorted(inst.completed, key=self._score, reverse=True)[: self.params.beam_width]
        tokenizer = self.engine.tokenizer
        for seq in best:
            if tokenizer is not None:  # the prompt's text too, as vLLM's; special tokens skipped
                seq.text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
        return BeamSearchOutput(best)

    def abort(self, inst: BeamSearchInstance | None = None) -> None:
        """Stop a prompt's search (every unfinished one by default): its live beams finish with
        "abort" and its rows leave the batch."""
        for one in [inst] if inst is not None else self.instances:
            if not one.finished:
                one.completed += [beam.finished("abort") for beam in one.beams]
                self._end(one)

    # ------------------------------------------------------------------ one round
    def _collect(self, inst: BeamSearchInstance) -> bool:
        """Take this step's candidates: a row that sampled appended its token, and the output
        processor its logprobs. A row stopped from outside (aborted, failed) ends the prompt's
        search, as in vLLM. Returns whether the search goes on."""
        for beam in inst.beams:
            row = beam.row
            if row is None or beam.candidates is not None:
                continue
            stopped = row.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
            if stopped:
                self.abort(inst)
                return False
            if row.num_tokens > len(beam.tokens):
                beam.candidates = row.logprobs[-1]
        return True

    def _prune(self, inst: BeamSearchInstance) -> None:
        """Rank every beam's candidates and give the survivors their rows."""
        children = []
        for beam in inst.beams:
            for token in beam.candidates:
                child = beam.child(token)
                if token in self.eos_token_ids:
                    inst.completed.append(child.finished("stop", token))
                else:
                    children.append(child)
        kept = sorted(children, key=self._score, reverse=True)[: self.params.beam_width]
        num_generated = len(inst.beams[0].tokens) + 1 - len(inst.prompt_token_ids)
        if not kept or num_generated == self.params.max_tokens:
            inst.completed += [child.finished("length") for child in kept]
            self._end(inst)
            return
        # Beams left without a child leave the batch first: their blocks are free at once, and
        # their seats go to the forks below.
        for beam in inst.beams:
            childless = not any(child.parent is beam for child in kept)
            if childless and beam.row is not None:
                self._drop(beam.row)
        for beam in inst.beams:
            mine = [child for child in kept if child.parent is beam]
            if mine:
                self._give_rows(inst, beam, mine)
        for spare in inst.spares:  # round 1's seats that no candidate needed
            self._drop(spare)
        inst.spares = []
        inst.beams = kept

    def _give_rows(self, inst: BeamSearchInstance, parent: Beam, children: list[Beam]) -> None:
        """The first child continues in the parent's row; the others fork from it."""
        row = parent.row
        for child in children[1:]:
            child.row = self._fork(inst, row, child.tokens)
        if row is None:  # the parent left the batch: its first child comes back as a request too
            children[0].row = self._resubmit(inst, children[0].tokens)
            return
        # the row's newest token is not in the cache yet: the child's token takes its place
        row.token_ids[-1] = children[0].tokens[-1]
        children[0].row = row

    def _fork(self, inst: BeamSearchInstance, row: Request | None, tokens: list[int]) -> Request:
        """A row for `tokens`, forked from `row` (the parent's) so that it shares all its blocks."""
        spares = [spare for spare in inst.spares if not spare.is_finished]
        if spares:  # round 1: a reserved seat, forked after the prefill, already shares them
            inst.spares.remove(spares[0])
            spares[0].token_ids[-1] = tokens[-1]
            return spares[0]
        seats_taken = sum(r.num_seqs for r in self.scheduler.running)
        has_seat = seats_taken < self.engine.config.max_num_seqs
        if row is None or not has_seat:
            return self._resubmit(inst, tokens)
        child = self._new_row(inst)
        row.forks = [child]
        self.scheduler.fork(row)  # shares every block (reference counts up, nothing copied)
        child.token_ids[-1] = tokens[-1]
        return child

    def _resubmit(self, inst: BeamSearchInstance, tokens: list[int]) -> Request:
        """A waiting row for `tokens`: admitted like a request preempted by recompute, it finds its
        full blocks in the prefix cache while they are still there."""
        child = self._new_row(inst)
        child.token_ids = list(tokens)
        self.scheduler.add_request(child)
        return child

    def _new_row(self, inst: BeamSearchInstance) -> Request:
        taken = self.engine.output_processor.owner
        while (request_id := f"{inst.num_rows}_{inst.request_id}") in taken:
            inst.num_rows += 1
        inst.num_rows += 1
        row = Request(
            request_id, inst.prompt_token_ids, self.row_params, arrival_index=inst.arrival_index
        )
        self.engine.output_processor.add_request([row])
        self._without_text(row)
        return row

    def _without_text(self, row: Request) -> None:
        """A row's tokens change under it (a child's replaces the sampled one), so it keeps no
        incremental text: the beams' text is decoded once, at the end."""
        self.engine.output_processor.detokenizers.pop(row.request_id, None)

    def _drop(self, row: Request) -> None:
        self.scheduler.abort_request(row.request_id)  # blocks back at once (no-op once finished)

    def _end(self, inst: BeamSearchInstance) -> None:
        for row in [beam.row for beam in inst.beams if beam.row is not None] + inst.spares:
            self._drop(row)
        inst.beams = []
        inst.spares = []
        inst.finished = True

    def _score(self, seq) -> float:
        return get_beam_search_score(
            seq.tokens, seq.cum_logprob, self.engine.eos_token_ids, self.params.length_penalty
        )

"""ModelRunner: turns one SchedulerOutput into flat tensors, runs the model once, samples.

This is the seam between the scheduler's world (requests, block tables, token counts) and the
model's world (one flat batch of tokens). Every scheduled row contributes `num_tokens`
consecutive tokens to `input_ids`; `positions` give each token's place in its own sequence;
`cache_locs` says where its K/V goes in the paged cache; `block_tables` and `context_lens`
say what each row may attend to. There is no padding between requests: a step with 60 decodes
and one 200-token prefill chunk is a (260, hidden) matrix, which is what makes mixing prefill
and decode in one step cheap.

Decode-only steps may instead be replayed from a captured CUDA graph (`graph_runner`, a
DecodeGraphRunner from cuda_graph.py, set by the engine when `use_cuda_graph` is on): it copies
the same inputs into static buffers and returns the same logits. Sampling always runs here,
outside the graph, and the eager path below is the reference every graph must match.
"""

from dataclasses import dataclass, field, replace
from itertools import accumulate

import torch

from ..config import cdiv
from ..core.request import Request
from ..core.scheduler import SchedulerOutput
from ..model_executor.attention import (
    AttentionMetadata,
    cache_locations,
    pad_tables,
    to_device,
)
from ..model_executor.fused_moe import expert_load
from ..model_executor.paged_flash import decode_pages
from ..model_executor.ragged_attention import decode_groups
from ..outputs import Logprob
from ..sample.logprobs import gather_logprobs, logprobs, prompt_logprobs
from ..sample.penalties import process_logits
from ..sample.rejection_sampler import verify_drafts
from ..sample.sampler import Sampler
from ..spec_decode.ngram_proposer import SpecDecodingStats
from ..structured_output import apply_grammars
from .expert_parallel import expert_traffic
from .kv_cache import block_transfers


@dataclass
class ModelRunnerOutput:
    """What one step produced (vLLM's name). `sampled_token_ids` holds one token per row with
    `do_sample`, in row order, except that a row whose request is about to fork its n samples
    holds n tokens in a row: its own, then its forks' (None: that sequence's sampling failed)."""

    sampled_token_ids: list[int | None] = field(default_factory=list)
    # request id -> this token's
    logprobs: dict[str, dict[int, Logprob]] = field(default_factory=dict)
    # id -> new entries
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    # request id -> why its sampling failed
    errors: dict[str, Exception] = field(default_factory=dict)
    # id -> drafts kept, before its sampled token
    accepted_drafts: dict[str, list[int]] = field(default_factory=dict)
    # async scheduling: the sampled tokens left on the device (executor.py brings them to the host)
    pending_tokens: object = None
    # a mixture of experts: (moe_layers, num_experts) tokens routed to each expert, on the device
    expert_load: object = None
    # and with expert parallelism, per MoE layer: (ranks, ranks) pairs sent from each rank's share
    # of the tokens to each rank's experts (expert_parallel.py)
    expert_traffic: list | None = None


@dataclass
class HostInputs:
    """One step's inputs as plain Python lists, before they become tensors (the part of input
    preparation that runs on the CPU between two GPU steps, and that W3 times). Attention rows are
    the scheduler's rows. A decode row that verifies k drafts (spec_decode/) is, as in vLLM V1, a
    decode row with 1 + k query tokens: one attention row whose tokens attend causally within it and
    to its cache, which the decode paths read once for all of them. Decode rows (the scheduler's
    decode rows, and a prompt's one-token chunk) lead the batch."""

    input_ids: list[int]  # (num_tokens,): every scheduled token of every row, rows concatenated
    positions: list[int]  # (num_tokens,): each token's position in its own sequence
    block_tables: list[list[int]]  # per attention row: only the blocks in use after this step
    context_lens: list[int]  # per attention row: tokens in the cache after this step's writes
    query_lens: list[int]  # per attention row: tokens fed this step
    num_decodes: int  # the leading decode rows (1 token, or 1 + k verifying k drafts)
    sample_rows: list[int]  # scheduler rows that sample a token this step
    row_starts: list[int]  # per scheduler row: the index of its first token in input_ids
    # the tokens whose logits are computed: each sampling row's last, a verifying row's all
    logits_indices: list[int]
    num_decode_tokens: int = 0  # vLLM's name: the tokens of the leading decode rows
    # KV cache groups 1, 2, ...: per group, per attention row, like block_tables (group 0's)
    group_tables: list[list[list[int]]] = field(default_factory=list)


def host_inputs(out: SchedulerOutput, block_size: int) -> HostInputs:
    inputs = HostInputs([], [], [], [], [], 0, [], [], [])
    for i, row in enumerate(out.scheduled):
        start, n = row.start, row.num_tokens
        inputs.row_starts.append(len(inputs.input_ids))
        inputs.input_ids += row.token_ids
        inputs.positions += range(start, start + n)
        is_decode = n == 1 or not row.is_prefill  # one token, or a verifying row
        if is_decode and inputs.num_decodes == len(inputs.context_lens):
            inputs.num_decodes += 1
            inputs.num_decode_tokens += n
        inputs.context_lens.append(start + n)
        inputs.query_lens.append(n)
        inputs.block_tables.append(row.block_table[: cdiv(start + n, block_size)])
        if len(row.block_ids) > 1:  # KV cache groups: each group's table, the same columns
            if not inputs.group_tables:
                inputs.group_tables = [[] for _ in row.block_ids[1:]]
            for tables, table in zip(inputs.group_tables, row.block_ids[1:]):
                tables.append(table[: cdiv(start + n, block_size)])
        if row.do_sample:
            inputs.sample_rows.append(i)
            inputs.logits_indices += range(
                len(inputs.input_ids) - 1 - len(row.spec_token_ids), len(inputs.input_ids)
            )
    return inputs


class ModelRunner:
    def __init__(self, model, kv_cache, config, device):
        self.model = model
        self.kv_cache = kv_cache
        self.config = config
        self.device = torch.device(device)
        self.sampler = Sampler(config.seed)
        self.graph_runner = None  # a DecodeGraphRunner when CUDA graphs are enabled
        # parallel.TensorParallel with tensor_parallel_size > 1: workers mirror every step
        self.tp = None
        # or "flash_pages": the engine picks (config.attention_backend)
        self.attention_backend = "gather"
        self.spec_stats = SpecDecodingStats()  # drafts verified and accepted (speculative decoding)
        # the last step's sampled tokens on the device, {sequence id: index} (async scheduling)
        self.last_sampled = None
        # rows and table columns of the last graph replayed
        self.last_graph_bucket = self.last_graph_width = None

    def prepare_inputs(self, out: SchedulerOutput):
        """(input_ids, positions, meta, logits_indices): everything the forward pass needs."""
        return self.inputs_from_host(host_inputs(out, self.config.block_size))

    def inputs_from_host(self, h: HostInputs):
        meta = AttentionMetadata.build(
            h.block_tables,
            h.context_lens,
            h.query_lens,
            h.num_decodes,
            self.config.block_size,
            self.kv_cache.sink_block_id,
            self.device,
        )
        nd = h.num_decodes
        reads_pages_in_place = self.attention_backend == "flash_pages" and nd
        groups_decodes_on_cpu = self.device.type == "cpu" and nd
        if reads_pages_in_place:  # decode reads the pages in place
            meta.pages = self._pages(meta, 0)
        elif groups_decodes_on_cpu:  # eager CPU: decode rows grouped by length, once a step
            meta.decode_groups = self._decode_groups(h, h.block_tables)
        if h.group_tables:  # KV cache groups: the same rows, each group's blocks
            metas = enumerate(h.group_tables, 1)
            meta = [meta] + [self._group_meta(meta, h, tables, g) for g, tables in metas]
        as_tensor = lambda x: to_device(x, self.device)
        return as_tensor(h.input_ids), as_tensor(h.positions), meta, h.logits_indices

    def _pages(self, meta: AttentionMetadata, group: int):
        kv = self.kv_cache
        return decode_pages(meta, self.config.block_size, kv.num_locations, kv.group_windows[group])

    def _group_meta(self, meta: AttentionMetadata, h: HostInputs, tables, group: int):
        """Another group's metadata: only where its tokens go and which blocks it reads differ."""
        bs, sink = self.config.block_size, self.kv_cache.sink_block_id
        width = max((len(t) for t in tables), default=0)
        locs = cache_locations(tables, h.context_lens, h.query_lens, bs)
        grouped = self.device.type == "cpu" and h.num_decodes
        meta = replace(
            meta,
            cache_locs=to_device(locs, self.device),
            block_tables=to_device(pad_tables(tables, width, sink), self.device),
            decode_groups=self._decode_groups(h, tables) if grouped else None,
        )
        if self.attention_backend == "flash_pages" and h.num_decodes:  # this group's pages
            meta.pages = self._pages(meta, group)
        return meta

    def _decode_groups(self, h: HostInputs, tables):
        nd = h.num_decodes
        return decode_groups(
            tables[:nd],
            h.context_lens[:nd],
            self.config.block_size,
            self.kv_cache.sink_block_id,
            self.kv_cache.dtype,
            self.device,
            h.query_lens[:nd],
        )

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        h: HostInputs | None = None,
        before_sampling=None,
        defer: bool = False,
        fill=None,
    ) -> ModelRunnerOutput:
        """Run one step: block copies, one forward pass, sampling (see ModelRunnerOutput). `h`: its
        host inputs, if already built; `before_sampling`: called once the logits are ready (async
        scheduling waits there until the step before has been processed); `defer`: leave the
        sampled tokens on the device (`pending_tokens`); `fill`: (positions, tokens) to write over
        the input ids, on the device (async scheduling's placeholders: executor.py)."""
        self.kv_cache.transfer(*block_transfers(out))  # block copies first (KVCache.transfer)
        self.last_graph_bucket = self.last_graph_width = None
        result = ModelRunnerOutput()
        rows = out.scheduled
        if h is None and rows:
            h = host_inputs(out, self.config.block_size)
        self.last_sampled = None
        if self.tp is not None:  # every worker does the same block copies and forward on its shard
            if fill is not None:  # the workers need the tokens themselves
                for j, token in zip(fill[0].tolist(), fill[1].tolist()):
                    h.input_ids[j] = token
            self.tp.step(out, h)
        if not rows:
            return result
        runs_graph = self.graph_runner is not None and self.graph_runner.can_run(out)
        if runs_graph:  # decode rows only, fits a graph
            # (num_tokens, vocab): every token of such a step is scored
            logits = self.graph_runner.run(out, h, fill)
            result.expert_load = _copy(self.graph_runner.expert_load)
            self.last_graph_bucket = self.graph_runner.last_bucket
            self.last_graph_width = self.graph_runner.last_width
        else:
            input_ids, positions, meta, logits_indices = self.inputs_from_host(h)
            if fill is not None:
                input_ids[fill[0]] = fill[1]
            hidden = self.model(input_ids, positions, self.kv_cache, meta)  # (num_tokens, hidden)
            result.expert_load = _copy(expert_load(self.model))
            result.expert_traffic = expert_traffic(self.model)  # None unless experts are spread
            result.prompt_logprobs = prompt_logprobs(
                rows, hidden, h.row_starts, self.model.compute_logits
            )
            if not h.sample_rows:
                return result
            logits = self.model.compute_logits(hidden[to_device(logits_indices, self.device)])
        if before_sampling is not None:
            before_sampling()
        # (num_logits, vocab): one row per sampling row, k + 1 for a row verifying k drafts. Its
        # last one samples.
        last = [
            end - 1 for end in accumulate(1 + len(rows[i].spec_token_ids) for i in h.sample_rows)
        ]
        last_logits = (
            logits if len(last) == logits.shape[0] else logits[to_device(last, self.device)]
        )
        # A request about to fork samples its n first tokens from its one row of logits.
        seqs = [seq for i in h.sample_rows for seq in [rows[i].request, *rows[i].request.forks]]
        if len(seqs) > len(h.sample_rows):
            repeat = [
                j for j, i in enumerate(h.sample_rows) for _ in range(rows[i].request.num_seqs)
            ]
            last_logits = last_logits[to_device(repeat, self.device)]  # (num_seqs, vocab)
        self.sample(last_logits, seqs, result, defer)
        has_drafts = len(last) < logits.shape[0]
        if has_drafts:  # drafts to verify: which are kept, and the token after them
            verify_drafts(
                [rows[i] for i in h.sample_rows],
                last,
                logits,
                result,
                self.sampler,
                self._generator,
                self.spec_stats,
            )
        return result

    def _generator(self, req):
        """A seeded request keeps one generator for its whole life (made on its first sample)."""
        if req.generator is None and req.params.seed is not None:
            req.generator = self.sampler.generator_for(req.params.seed, self.device)
        return req.generator

    def sample(self, logits, seqs: list[Request], result: ModelRunnerOutput, defer=False) -> None:
        """One token per row of logits (one per sequence in `seqs`), all rows in one call: logits
        processors, then log-probabilities where asked, then the draw. If that fails, the rows are
        sampled one by one, so a request whose own settings break sampling fails alone (its token
        is None) and every other request of the batch still gets its token. The tokens stay on the
        device for the next step's placeholders (`last_sampled`); `defer`: only there."""
        found = None  # the tokens on the host, when the rows were sampled one by one
        try:
            tokens = self._sample(logits, seqs, result)
        except Exception:
            found = []
            for i, seq in enumerate(seqs):
                try:
                    found += self._sample(logits[i : i + 1], [seq], result).tolist()
                except Exception as e:
                    found.append(None)
                    result.errors[seq.request_id] = e
            tokens = torch.tensor([0 if t is None else t for t in found], device=self.device)
        self.last_sampled = (tokens, {seq.request_id: i for i, seq in enumerate(seqs)})
        if found is not None:
            result.sampled_token_ids += found
        elif defer:
            result.pending_tokens = tokens
        else:
            result.sampled_token_ids += tokens.tolist()

    def _sample(self, logits, seqs: list[Request], result: ModelRunnerOutput):
        params = [s.params for s in seqs]
        logits = apply_grammars(logits, seqs)  # structured outputs: forbidden tokens at -inf
        # (n, vocab): the very tensor when none is set
        logits = process_logits(logits, params, seqs)
        tokens = self.sampler(logits, params, [self._generator(s) for s in seqs])  # (n,)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if rows:  # (these tokens are read on the host now)
            picked = torch.tensor(rows, device=logits.device)
            found = gather_logprobs(
                logprobs(logits[picked]),
                tokens[picked].tolist(),
                [params[i].logprobs for i in rows],
            )
            result.logprobs.update((seqs[i].request_id, lp) for i, lp in zip(rows, found))
        return tokens


def _copy(load: torch.Tensor | None) -> torch.Tensor | None:
    """The step's tokens per expert, kept apart from the buffer the next step overwrites."""
    return None if load is None else load.clone()

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

from dataclasses import dataclass

import torch

from .attention import AttentionMetadata
from .config import cdiv
from .scheduler import SchedulerOutput
from .sampler import Sampler


@dataclass
class HostInputs:
    """One step's inputs as plain Python lists, before they become tensors (the part of input
    preparation that runs on the CPU between two GPU steps, and that W3 times)."""

    input_ids: list[int]  # (num_tokens,): every scheduled token of every row, rows concatenated
    positions: list[int]  # (num_tokens,): each token's position in its own sequence
    block_tables: list[list[int]]  # per row: only the blocks in use after this step
    context_lens: list[int]  # per row: tokens in the cache after this step's writes
    query_lens: list[int]  # per row: tokens fed this step
    num_decodes: int  # the leading one-token rows, which take the batched decode path
    sample_rows: list[int]  # rows that sample a token this step


def host_inputs(out: SchedulerOutput, block_size: int) -> HostInputs:
    inputs = HostInputs([], [], [], [], [], 0, [])
    for i, row in enumerate(out.scheduled):
        start, n = row.start, row.num_tokens
        inputs.input_ids += row.token_ids
        inputs.positions += range(start, start + n)
        inputs.context_lens.append(start + n)
        inputs.query_lens.append(n)
        inputs.block_tables.append(row.block_table[:cdiv(start + n, block_size)])
        if n == 1 and inputs.num_decodes == i:
            inputs.num_decodes += 1
        if row.do_sample:
            inputs.sample_rows.append(i)
    return inputs


class ModelRunner:
    def __init__(self, model, kv_cache, config, device):
        self.model = model
        self.kv_cache = kv_cache
        self.config = config
        self.device = torch.device(device)
        self.sampler = Sampler(config.seed)
        self.graph_runner = None  # a DecodeGraphRunner when CUDA graphs are enabled
        self.last_graph_bucket: int | None = None

    def prepare_inputs(self, out: SchedulerOutput):
        """(input_ids, positions, meta, sample_rows): everything the forward pass needs."""
        h = host_inputs(out, self.config.block_size)
        meta = AttentionMetadata.build(h.block_tables, h.context_lens, h.query_lens, h.num_decodes,
                                       self.config.block_size, self.kv_cache.sink_block_id, self.device)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)
        return as_tensor(h.input_ids), as_tensor(h.positions), meta, h.sample_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[int | None], dict[str, Exception]]:
        """Run one step. Returns the sampled token of every row with `do_sample`, in row order, and
        the requests whose own sampling failed (request id -> error; their token is None)."""
        # Swaps first: a block swapped out this step may be handed to another request below.
        if out.blocks_to_swap_out:
            self.kv_cache.swap_out(out.blocks_to_swap_out)
        if out.blocks_to_swap_in:
            self.kv_cache.swap_in(out.blocks_to_swap_in)
        self.last_graph_bucket = None
        if not out.scheduled:
            return [], {}
        rows = out.scheduled
        if self.graph_runner is not None and self.graph_runner.can_run(out):  # decode-only, fits a bucket
            logits = self.graph_runner.run(out)  # (num_rows, vocab), every row samples
            self.last_graph_bucket = self.graph_runner.last_bucket
            sample_rows = list(range(len(rows)))
        else:
            input_ids, positions, meta, sample_rows = self.prepare_inputs(out)
            hidden = self.model(input_ids, positions, self.kv_cache, meta)  # (num_tokens, hidden)
            if not sample_rows:
                return [], {}
            last_token = meta.query_start_loc[1:] - 1  # (num_seqs,) index of each row's last token
            if len(sample_rows) < len(rows):
                last_token = last_token[torch.tensor(sample_rows, device=self.device)]
            logits = self.model.compute_logits(hidden[last_token])  # (num_sampled, vocab)
        return self.sample(logits, [rows[i].request for i in sample_rows])

    def _generator(self, req):
        """A seeded request keeps one generator for its whole life (made on its first sample)."""
        if req.generator is None and req.params.seed is not None:
            req.generator = self.sampler.generator_for(req.params.seed, self.device)
        return req.generator

    def sample(self, logits, requests) -> tuple[list[int | None], dict[str, Exception]]:
        """One token per row, all rows in one call. If that call fails, the rows are sampled one by
        one, so a request whose own settings break the sampler fails alone (its token is None) and
        every other request of the batch still gets its token."""
        try:
            generators = [self._generator(r) for r in requests]
            return self.sampler(logits, [r.params for r in requests], generators).tolist(), {}
        except Exception:
            tokens, errors = [], {}
            for i, req in enumerate(requests):
                try:
                    tokens.append(self.sampler(logits[i:i + 1], [req.params], [self._generator(req)]).item())
                except Exception as e:
                    tokens.append(None)
                    errors[req.request_id] = e
            return tokens, errors

"""FlashAttention's online softmax and FlashDecoding's split-KV, over minicb's paged KV cache, in
plain PyTorch.

A reference to read, not a kernel to run: nothing in the engine imports this module. It takes
exactly the arguments of `minicb.model_executor.attention.decode_attention` (one query per sequence,
block tables, context lengths, grouped-query heads) and returns the same output, without gathering
the blocks into a padded copy:

  online_softmax_decode  walk each sequence's blocks in table order, keeping a running max, a
  running sum
                         and a running weighted sum of values (the online softmax of Milakov &
                         Gimelshein, 2018, the heart of FlashAttention, Dao et al., 2022). No score
                         row, no gathered copy.
  split_kv_partials      cut the table into chunks of blocks; each chunk returns its normalized
  output and
                         the log-sum-exp of its scores (FlashDecoding, Dao, Haziza, Massa & Sizov,
                         2023; vLLM's PagedAttention v2 with its 512-token partitions).
  combine_partials       merge the chunks exactly: weight each by its share of the softmax mass
                         (split_kv_decode = split_kv_partials, then combine_partials).

The traffic functions count the bytes each variant moves through device memory for one layer's
decode, next to minicb's gather-then-SDPA (DecodeShape -> Traffic).
"""

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from ..config import cdiv

# --- online softmax
# -----------------------------------------------------------------------------------


class RunningSoftmax(NamedTuple):
    """What an online softmax keeps between blocks, for each (sequence, query head): the scores seen
    so far are never stored, only these three summaries of them. Leading dims (...) are any batch
    shape."""

    max: torch.Tensor  # (...,) largest score seen so far; -inf before any real score
    sum: torch.Tensor  # (...,) sum of exp(score - max) over the scores seen
    acc: torch.Tensor  # (..., head_dim) sum of exp(score - max) * value over the scores seen


def start_softmax(shape, head_dim: int, dtype, device="cpu") -> RunningSoftmax:
    """The state before the first block: nothing seen (max -inf, sums 0)."""
    return RunningSoftmax(
        torch.full(shape, float("-inf"), dtype=dtype, device=device),
        torch.zeros(shape, dtype=dtype, device=device),
        torch.zeros((*shape, head_dim), dtype=dtype, device=device),
    )


def online_softmax_update(state: RunningSoftmax, scores, values) -> RunningSoftmax:
    """Fold one block in. scores: (..., n), -inf where masked; values: (..., n, head_dim).

    When the block holds a bigger score, the old sums were computed against a smaller max: multiply
    them by exp(old_max - new_max) (<= 1) so that every term is exp(score - new_max). Forgetting
    this rescale is the classic bug; it is exact whenever the max never grows, so test with growing
    maxima.
    """
    new_max = torch.maximum(state.max, scores.amax(dim=-1))
    # A row that has only seen masked scores still has max -inf; shift it by 0 instead, so that no
    # exp(-inf - -inf) = NaN appears (its sums stay 0, its acc stays 0).
    shift = torch.where(torch.isneginf(new_max), torch.zeros_like(new_max), new_max)
    rescale = torch.exp(state.max - shift)  # (...,) 0 for a row that had seen nothing
    p = torch.exp(scores - shift[..., None])  # (..., n) unnormalized probabilities, 0 where masked
    return RunningSoftmax(
        new_max,
        state.sum * rescale + p.sum(dim=-1),
        state.acc * rescale[..., None] + torch.einsum("...t,...td->...d", p, values),
    )


def finish_softmax(state: RunningSoftmax) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, lse): acc / sum, and log(sum of exp(score)) = max + log(sum). A state that saw no
    score (an empty split) gives output 0 and lse -inf, which the combine weighs with exp(-inf) =
    0."""
    out = state.acc / torch.where(state.sum > 0, state.sum, torch.ones_like(state.sum))[..., None]
    return out, state.max + torch.log(state.sum)


# --- the block-by-block walk over the paged cache
# -----------------------------------------------------


def block_scores(
    q, k_cache, v_cache, block_tables, context_lens, col: int, scale, sliding_window=None
):
    """Scores and values of table column `col` for every sequence: the one block a kernel loads
    next.

    q: (B, num_heads, head_dim). Returns scores (B, kv_heads, group, block_size), -inf at positions
    past context_len (or outside the sliding window), and values (B, kv_heads, block_size,
    head_dim).
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    # (B,) the physical block holding positions col*block_size .. +block_size-1
    ids = block_tables[:, col]
    k = k_cache.index_select(0, ids)  # (B, block_size, kv_heads, head_dim): one block per sequence
    v = v_cache.index_select(0, ids)
    # Grouped-query attention as in decode_attention: query head h reads kv head h // group.
    qg = q.view(batch, kv_heads, num_heads // kv_heads, head_dim)  # (B, kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k) * scale  # (B, kv_heads, group, block_size)
    positions = col * block_size + torch.arange(block_size, device=q.device)  # absolute positions
    allowed = positions < context_lens[:, None]  # (B, block_size)
    if sliding_window is not None:  # the query sits at position context_len - 1
        allowed &= positions > context_lens[:, None] - 1 - sliding_window
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    return scores, v.transpose(1, 2)


def walk_blocks(q, k_cache, v_cache, block_tables, context_lens, scale, cols, sliding_window=None):
    """Online softmax over the table columns `cols` (a range), one block at a time -> RunningSoftmax
    with leading dims (B, kv_heads, group). At most one block of scores exists at any moment.

    A kernel stops at each sequence's own last block; this loop walks the same columns for the whole
    batch and masks, which changes the work but not the result (a fully masked block leaves a state
    as it is).
    """
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if num_heads % kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={kv_heads}")
    state = start_softmax((batch, kv_heads, num_heads // kv_heads), head_dim, q.dtype, q.device)
    for col in cols:
        scores, values = block_scores(
            q, k_cache, v_cache, block_tables, context_lens, col, scale, sliding_window
        )
        # values broadcast over the group
        state = online_softmax_update(state, scores, values[:, :, None])
    return state


def online_softmax_decode(
    q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None
):
    """decode_attention, computed block by block with an online softmax. Same arguments, same
    result:
    (B, num_heads, head_dim)."""
    state = walk_blocks(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        range(block_tables.shape[1]),
        sliding_window,
    )
    out, _ = finish_softmax(state)
    return out.reshape(q.shape)


# --- split-KV (FlashDecoding)
# -------------------------------------------------------------------------


def blocks_per_split(table_width: int, num_splits: int) -> int:
    """Each split takes ceil(width / num_splits) consecutive blocks, as a kernel with a fixed
    partition size does (vLLM's v2: 512 tokens)."""
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return max(1, cdiv(table_width, num_splits))


def split_columns(table_width: int, num_splits: int) -> list[range]:
    """The table columns of each split. With more splits than blocks, the trailing splits are
    empty."""
    per_split = blocks_per_split(table_width, num_splits)
    return [
        range(min(s * per_split, table_width), min((s + 1) * per_split, table_width))
        for s in range(num_splits)
    ]


def split_kv_partials(
    q, k_cache, v_cache, block_tables, context_lens, scale, num_splits: int, sliding_window=None
):
    """Each split attends to its own chunk of blocks, independently of the others (on a GPU, in
    parallel).

    Returns outs (B, num_heads, num_splits, head_dim), each normalized over its own chunk, and
    lses (B, num_heads, num_splits), the log-sum-exp of the chunk's scores: -inf for a chunk with no
    position of the sequence (past its context_len, or an empty split). vLLM's PagedAttention v2
    keeps the same per-partition data, as tmp_out, max_logits and exp_sums (lse = max_logit +
    log(exp_sum)).
    """
    batch, num_heads, head_dim = q.shape
    outs, lses = [], []
    for cols in split_columns(block_tables.shape[1], num_splits):
        state = walk_blocks(
            q, k_cache, v_cache, block_tables, context_lens, scale, cols, sliding_window
        )
        out, lse = finish_softmax(state)
        outs.append(out.reshape(batch, num_heads, head_dim))
        lses.append(lse.reshape(batch, num_heads))
    return torch.stack(outs, dim=2), torch.stack(lses, dim=2)


def combine_partials(outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge split partials exactly. outs: (..., num_splits, head_dim); lses: (..., num_splits).
    Returns out (..., head_dim) and the lse of all scores (...,), so that combined results can be
    combined again (a row whose splits are all empty gives out 0, lse -inf, like an empty split).

    Split s holds exp(lse_s) of the total softmax mass; its weight is exp(lse_s) / sum_t exp(lse_t),
    computed against the largest lse so that no exp overflows.
    """
    top = lses.amax(dim=-1, keepdim=True)  # (..., 1)
    # all empty: shift by 0, not -inf
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    weights = torch.exp(lses - top)  # (..., num_splits) in [0, 1]; 0 for an empty split
    # (...,) >= 1 (the largest split weighs exactly 1), or 0 if all are empty
    total = weights.sum(dim=-1)
    out = (
        torch.einsum("...s,...sd->...d", weights, outs)
        / torch.where(total > 0, total, 1.0)[..., None]
    )
    return out, top.squeeze(-1) + torch.log(total)


def split_kv_decode(
    q, k_cache, v_cache, block_tables, context_lens, scale, num_splits: int, sliding_window=None
):
    """decode_attention as FlashDecoding computes it: partials per split, then the combine. (B,
    num_heads, head_dim)."""
    outs, lses = split_kv_partials(
        q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, sliding_window
    )
    return combine_partials(outs, lses)[0]


# --- bytes moved through device memory by one layer's decode attention
# -----------------------------------


@dataclass(frozen=True)
class DecodeShape:
    """What decides the traffic of one decode layer: the batch's context lengths and the cache
    layout."""

    context_lens: tuple[int, ...]
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bytes per element of q, K, V and the output (bfloat16)
    acc_bytes: int = 4  # bytes per score, probability or partial (kernels accumulate in float32)
    table_width: int | None = None  # columns of the padded table: None = the batch's longest table

    @classmethod
    def of(cls, q, k_cache, block_tables, context_lens, acc_bytes: int = 4) -> "DecodeShape":
        """The shape of a decode_attention call, from its own arguments (reads context_lens on the
        host)."""
        _, block_size, kv_heads, head_dim = k_cache.shape
        return cls(
            tuple(context_lens.tolist()),
            block_size,
            q.shape[1],
            kv_heads,
            head_dim,
            q.element_size(),
            acc_bytes,
            block_tables.shape[1],
        )

    def num_blocks(self, context_len: int) -> int:
        return cdiv(context_len, self.block_size)

    @property
    def width(self) -> int:
        return self.table_width or max(self.num_blocks(n) for n in self.context_lens)

    @property
    def kv_bytes_per_position(self) -> int:
        """K and V of one token in one layer: 2 * kv_heads * head_dim elements."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def head_bytes(self) -> int:
        """One (sequence, all query heads) row of q or of the output."""
        return self.num_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Traffic:
    """Bytes one layer's decode attention reads plus writes in device memory, by what they carry.
    Not counted: block tables and masks (a few bytes per block or position) and what stays on
    chip."""

    kv_read: int  # K/V read from the paged cache
    kv_copy: int  # K/V written to a gathered copy and read back from it
    scores: int  # scores and probabilities written to memory and read back
    partials: int  # split outputs and log-sum-exps written, then read by the combine
    q_out: int  # queries read, outputs written

    @property
    def total(self) -> int:
        return self.kv_read + self.kv_copy + self.scores + self.partials + self.q_out

    def __repr__(self):
        return (
            f"Traffic(total={self.total:,} B: kv_read={self.kv_read:,} kv_copy={self.kv_copy:,} "
            f"scores={self.scores:,} partials={self.partials:,} q_out={self.q_out:,})"
        )


def gather_sdpa_traffic(shape: DecodeShape) -> Traffic:
    """minicb's decode_attention with a fused SDPA: the gather reads every block of the padded table
    (width columns for every row) and writes the copy; SDPA reads the copy once, keeping scores on
    chip."""
    gathered = (
        len(shape.context_lens) * shape.width * shape.block_size * shape.kv_bytes_per_position
    )
    return Traffic(
        kv_read=gathered,
        kv_copy=2 * gathered,
        scores=0,
        partials=0,
        q_out=2 * len(shape.context_lens) * shape.head_bytes,
    )


def materialized_traffic(shape: DecodeShape) -> Traffic:
    """The same gather, then textbook attention: the score row of every query head goes to memory
    (write scores, read them for the softmax, write probabilities, read them for probs @ V)."""
    positions = len(shape.context_lens) * shape.width * shape.block_size  # every gathered position
    row = shape.num_heads * positions * shape.acc_bytes
    return replace(gather_sdpa_traffic(shape), scores=4 * row)


def online_traffic(shape: DecodeShape) -> Traffic:
    """The block walk, as a fused kernel runs it: each sequence's own blocks, read once in place, up
    to its last block (whole blocks: the unused tail of the last one is loaded and masked). Each KV
    head is read once for its whole query group (a kernel with one program per query head may read
    it group times)."""
    blocks = sum(shape.num_blocks(n) for n in shape.context_lens)
    return Traffic(
        kv_read=blocks * shape.block_size * shape.kv_bytes_per_position,
        kv_copy=0,
        scores=0,
        partials=0,
        q_out=2 * len(shape.context_lens) * shape.head_bytes,
    )


def split_kv_traffic(shape: DecodeShape, num_splits: int) -> Traffic:
    """The walk cut into splits: the same K/V reads, plus each non-empty split of each sequence
    reads the query and writes its partial (num_heads x (head_dim + 1) accumulators, out and lse),
    which the combine reads back before writing the output."""
    per_split = blocks_per_split(shape.width, num_splits)
    # non-empty splits
    programs = sum(cdiv(shape.num_blocks(n), per_split) for n in shape.context_lens)
    partial = shape.num_heads * (shape.head_dim + 1) * shape.acc_bytes
    kv_read = online_traffic(shape).kv_read
    return Traffic(
        kv_read=kv_read,
        kv_copy=0,
        scores=0,
        partials=2 * programs * partial,
        q_out=(programs + len(shape.context_lens)) * shape.head_bytes,
    )

"""KV cache groups: vLLM V1's hybrid KV cache manager, for models whose layers cache differently.

A model with sliding-window layers (Mistral's window, Gemma 3's five local layers for each global
one, gpt-oss's alternation) needs, in those layers, only the last `window` tokens of each request.
One block table for every layer (the design vLLM had until 2025, and minicb's with
disable_hybrid_kv_cache_manager) keeps every block of the request in every layer. vLLM V1 instead
groups the layers by their cache spec (full attention, or a sliding window of W) and gives each
group its own block table, every block still drawn from ONE pool:

  - the groups all have `group_size` layers (vLLM's _get_kv_cache_groups_uniform_page_size): the
    layers of one spec are split, by stride, into groups of that many; a last, shorter group is
    "padded" (its missing layers leave memory unused). Layer j of every group shares the j-th
    cache tensor, so a block id names one page in each of the group_size tensors and belongs to
    exactly one group at a time: every page is group_size x block_size tokens x one layer's K/V,
    the same bytes in every group. That is how vLLM makes the page sizes equal (here every layer's
    K/V per token is the same size; vLLM also multiplies a smaller layer's block size when they
    differ).
  - a sliding-window group frees each block that falls wholly out of the window as the request
    advances (vLLM's SlidingWindowManager.remove_skipped_blocks): the next query, at position
    num_computed, sees positions num_computed - W + 1 onward, so the tokens before that are skipped.
    The block table keeps its length; a freed entry points at the null block (minicb's sink block,
    which no request owns).
  - a prefix-cache hit in a sliding-window group needs only the blocks of the window before the
    hit's end; earlier ones stay null.

This module is the pure data: the groups of a model and the numbers each rule is made of.
block_manager.py keeps a table per group; the model runner builds attention metadata per group.
"""

from dataclasses import dataclass

from ..config import cdiv


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: its layers (model layer indices) and their window (None: full attention)."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None


def kv_cache_groups(
    windows: list[int | None], disable_hybrid_kv_cache_manager: bool = False
) -> tuple[KVCacheGroupSpec, ...]:
    """The groups of a model whose layer i has window `windows[i]` (None: full attention), by vLLM
    V1's rule: one group when every layer caches alike (or the hybrid manager is disabled: every
    layer then keeps every block, the window only masked); otherwise group_size = the fewest layers
    of one spec (the most, if the most is under 1.5x the fewest), and each spec's layers split by
    stride into cdiv(count, group_size) groups. Full attention first, then windows by size."""
    if not windows:
        raise ValueError("a model has at least one layer")
    if disable_hybrid_kv_cache_manager or len(set(windows)) == 1:
        window = windows[0] if not disable_hybrid_kv_cache_manager else None
        return (KVCacheGroupSpec(tuple(range(len(windows))), window),)
    by_spec: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        by_spec.setdefault(w, []).append(i)
    counts = [len(layers) for layers in by_spec.values()]
    group_size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    groups = []
    for w in sorted(by_spec, key=lambda w: -1 if w is None else w):
        layers = by_spec[w]
        n = cdiv(len(layers), group_size)
        groups += [KVCacheGroupSpec(tuple(layers[j::n]), w) for j in range(n)]
    return tuple(groups)


def group_size_of(groups) -> int:
    """Layers per group, padding included: how many cache tensors share the pool's block ids."""
    return max(len(g.layer_ids) for g in groups)


def num_padding_layers(groups) -> int:
    """Layer slots no layer uses (their memory is wasted, as vLLM's log warns)."""
    return group_size_of(groups) * len(groups) - sum(len(g.layer_ids) for g in groups)


def layer_slots(groups, num_layers: int) -> tuple[list[int], list[int]]:
    """(group of each layer, cache tensor of each layer): layer j of a group uses tensor j."""
    group_of, slot_of = [0] * num_layers, [0] * num_layers
    for g, spec in enumerate(groups):
        for j, layer in enumerate(spec.layer_ids):
            group_of[layer], slot_of[layer] = g, j
    return group_of, slot_of


def num_skipped_blocks(window: int | None, num_computed: int, block_size: int) -> int:
    """Leading blocks of a request that no query from position `num_computed` on can see: those
    wholly before num_computed - window + 1 (vLLM's get_num_skipped_tokens // block_size)."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def max_live_blocks(window: int, num_tokens: int, block_size: int) -> int:
    """The most blocks a sliding-window group holds for a request right after a step of
    `num_tokens` queries: cdiv(window - 1 + num_tokens, block_size), plus one because the window
    need not start on a block boundary (cdiv(window, block_size) + 1 for a decode)."""
    return cdiv(window - 1 + num_tokens, block_size) + 1


def blocks_per_request(groups, context_len: int, block_size: int, num_tokens: int = 1) -> int:
    """Pool blocks one request of `context_len` tokens holds in steady decode (or right after a step
    of `num_tokens` queries): every block in a full group, at most max_live_blocks in a window's."""
    full = cdiv(context_len, block_size)
    return sum(
        full
        if g.sliding_window is None
        else min(full, max_live_blocks(g.sliding_window, num_tokens, block_size))
        for g in groups
    )

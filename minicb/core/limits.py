"""What a request may ask for under an EngineConfig: the checks that refuse it before anything
changes.

A request that could never run (a prompt longer than the model allows, more KV blocks than the cache
has, more samples than slots) is refused when it is added, with an error naming the limit, rather
than waiting forever or failing in the middle of a step beside other requests. The InputProcessor
checks it before tokens reach the engine core, and Scheduler.add_request checks it again, since a
request can also be built by hand (notebooks, the simulator). Pure Python, like the scheduler.
"""

from ..config import EngineConfig
from .kv_cache_groups import KVCacheGroupSpec, blocks_per_request


def check_request(
    config: EngineConfig,
    num_prompt_tokens: int,
    max_tokens: int,
    priority: int = 0,
    num_samples: int = 1,
) -> None:
    """Raise ValueError, naming the limit, if such a request could never run under this config."""
    n = num_prompt_tokens
    if n == 0:
        raise ValueError("prompt is empty: at least one token is needed")
    if num_samples > config.max_num_seqs:  # the samples run side by side, one slot each
        raise ValueError(
            f"n={num_samples} samples need {num_samples} slots, but max_num_seqs is "
            f"{config.max_num_seqs}"
        )
    if priority != 0 and config.scheduling_policy != "priority":  # as vLLM refuses it
        raise ValueError(
            f"got priority {priority} but scheduling_policy is {config.scheduling_policy!r}: "
            "priorities are used only with scheduling_policy='priority'"
        )
    if config.max_model_len is not None and n + max_tokens > config.max_model_len:
        raise ValueError(
            f"prompt has {n} tokens and max_tokens is {max_tokens}: "
            f"{n + max_tokens} exceeds max_model_len {config.max_model_len}"
        )
    cached = n + max_tokens - 1  # the last generated token is never fed back, so never cached
    # KV cache groups: a block per group for each token it keeps, a window's only near its end
    groups = config.kv_cache_groups or (KVCacheGroupSpec(()),)
    chunk = min(cached, config.max_num_batched_tokens or cached)
    blocks = blocks_per_request(groups, cached, config.block_size, chunk)
    if config.num_blocks is not None and blocks > config.num_blocks:
        in_groups = f" over {len(groups)} KV cache groups" if len(groups) > 1 else ""
        raise ValueError(
            f"request needs up to {cached} tokens = {blocks} KV blocks of "
            f"{config.block_size}{in_groups}, but the cache has only num_blocks={config.num_blocks}"
        )
    if not config.enable_chunked_prefill and n > config.max_num_batched_tokens:
        raise ValueError(
            f"prompt has {n} tokens but max_num_batched_tokens is "
            f"{config.max_num_batched_tokens} and chunked prefill is disabled"
        )

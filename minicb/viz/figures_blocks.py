"""The figures of notebook 02, the block manager: prefix sharing, and the shared and copied blocks
of parallel sampling. Registered in figures.FIGURES beside the others, and made the same way: from
the simulator, with no model.
"""

from .. import viz
from ..config import EngineConfig, cdiv
from ..sim import SimRequest, simulate
from ..trace import Trace


def shared_prompt_run():
    """Four requests with a 12-token system prompt (3 blocks of 4) in steps 1, 3, 5, 7, a fifth in
    22."""
    system = list(range(900, 912))
    reqs = [
        SimRequest(
            prompt_len=14 + i,
            output_len=5 + 3 * i,
            arrival_step=1 + 2 * i,
            prompt_token_ids=system + list(range(100 * i, 100 * i + 2 + i)),
        )
        for i in range(4)
    ]
    reqs.append(
        SimRequest(prompt_len=14, output_len=4, arrival_step=22, prompt_token_ids=system + [7, 7])
    )
    return simulate(reqs, EngineConfig(max_num_seqs=4, block_size=4, num_blocks=24))


def prefix_sharing_grid():
    return viz.block_grid(
        shared_prompt_run().trace,
        7,
        title="Step 7: requests 1, 2 and 3 share the 3 blocks of a 12-token system prompt;\n"
        "block #3 is free but still caches request 0's prefix",
    )


def prefix_sharing_map():
    return viz.memory_map(
        shared_prompt_run().trace, title="Prefix sharing over time (24 blocks of 4 tokens)"
    )


def parallel_sampling_runs(
    n: int = 8, prompt_len: int = 200, block_size: int = 16, output_len: int = 16
):
    """(forked, separate, copies): n samples of one prompt (SamplingParams.n) and n separate
    requests with the same prompt, prefix caching off, with a token budget that prefills all n
    prompts in one step; `copies` maps each step of the forked run to its
    SchedulerOutput.blocks_to_copy."""
    config = EngineConfig(
        block_size=block_size,
        num_blocks=2 * n * cdiv(prompt_len + output_len, block_size),
        max_num_batched_tokens=n * prompt_len,
        enable_prefix_caching=False,
    )
    prompt, copies = list(range(prompt_len)), {}
    forked = simulate(
        [SimRequest(prompt_len, output_len, prompt_token_ids=prompt, n=n)],
        config,
        on_step=lambda sched, out: copies.update({out.step: out.blocks_to_copy}),
    )
    separate = simulate(
        [SimRequest(prompt_len, output_len, prompt_token_ids=prompt) for _ in range(n)], config
    )
    return forked, separate, copies


def first_step_past_prompt(trace: Trace, prompt_len: int) -> int:
    """The first step in which every request holds a block past its prompt's (decoding opened one
    each)."""
    prompt_blocks = cdiv(prompt_len, trace.block_size)
    return next(
        rec.step for rec in trace if all(len(t) > prompt_blocks for t in rec.block_tables.values())
    )


def parallel_sampling():
    forked, separate, _ = parallel_sampling_runs()
    step = first_step_past_prompt(forked.trace, 200)
    return viz.fork_map(
        forked.trace,
        separate.trace,
        step,
        200,
        title=(
            "n=8 samples of a 200-token prompt against 8 separate requests (blocks of 16 tokens, "
            f"prefix caching off)\nin step {step}, the first in which decoding has opened a new "
            "block for each"
        ),
    )

"""Moved to minicb.viz.figures; this alias goes once the notebooks import the new path.

Every public name of minicb.viz.figures is re-exported by name (tests/test_viz.py checks that none
is missing), so `from minicb.figures import FIGURES, relative_decode_throughput` keeps working.
"""

from .viz.figures import (ABCD, BURNERS, CONFIGS, CPU_KV_CACHE_BYTES, FIGURES, H100_BW, H100_FLOPS,  # noqa: F401
                          KIB, LLAMA2_7B, LLAMA3_8B, abcd_timeline, add_arguments, batch_throughput, fragmentation,
                          kv_bytes, kv_bytes_per_token_figure, main, paged_memory_map, policies, policy_latency,
                          preemption_map, prefix_sharing_grid, prefix_sharing_map, priority_timeline,
                          relative_decode_throughput, requests_that_fit, reservation_waste, speedup_by_distribution,
                          static_vs_continuous, swap_map, thrashing, utilization_exponential, worked_example)

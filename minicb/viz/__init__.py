"""Pictures of continuous batching, drawn from a Trace. Every function returns a matplotlib Figure.

Time runs left to right in steps everywhere, and a request keeps its colour in every picture.

  style     what every picture shares: request_colors, the CACHED grey, a fresh closed figure,
            the frame around the current step
  slots     slot_occupancy / compare_slot_occupancy: slots x steps, who ran where (prefill
            hatched, idle blank); utilization_curves: busy slots and free blocks per step
  blocks    block_views: the paged KV pool of every step rebuilt from the trace; memory_map
            (blocks x steps) and block_grid (one step): owner, fill, shared and cached blocks
  charts    request_timeline: one bar per request (waiting, prefill, decode, paused);
            latency_distributions: CDFs of TTFT / TPOT; curves / bars: back-of-envelope models
  sampling  fork_map: the blocks n samples of one prompt share, copy on write and open, beside n
            separate requests; block_kinds / count_kinds: the same from a trace, as data
  processes engine_core_processes: the API-server process and the engine-core process, and the
            messages on the pipe between them (no trace: a diagram of minicb/serve/engine_core.py)
  timeline  engine_loop_timeline: the host's and the device's work step by step in time, from each
            step's StepTimes (synchronous steps against async scheduling)
  moe       experts_touched (measured against E(1 - (1 - k/E)^B)), moe_roofline (weight bytes and
            arithmetic intensity of a decode step, dense against MoE), expert_load_map (experts x
            steps), expert_step / expert_step_through (one step's tokens per expert and per rank),
            rank_load (tokens per rank per step, max / mean, before and after rebalancing)
  widgets   step_through: a slider over the steps (ipywidgets), or the static figure headless
  figures   FIGURES, the registry behind `python -m minicb figures` (imported on its own, not here;
            notebook 02's figures live in figures_blocks)

Figures are made with pyplot and closed at once: a notebook then shows a figure exactly when it
displays it (no second copy at the end of the cell) and loops do not pile up open figures.
The package imports no torch: it draws traces from the simulator as well as from the engine.
"""

from ..trace import Trace
from .blocks import EVENTS, BlockView, block_grid, block_views, memory_map
from .charts import bars, curves, latency_distributions, request_timeline
from .moe import (
    expert_load_map,
    expert_step,
    expert_step_through,
    experts_touched,
    moe_roofline,
    rank_load,
)
from .processes import engine_core_processes
from .sampling import KINDS, block_kinds, count_kinds, fork_map
from .slots import compare_slot_occupancy, slot_occupancy, utilization_curves
from .style import CACHED, request_colors
from .timeline import engine_loop_timeline
from .widgets import step_through

__all__ = [
    "Trace",
    "CACHED",
    "EVENTS",
    "BlockView",
    "block_views",
    "memory_map",
    "block_grid",
    "slot_occupancy",
    "compare_slot_occupancy",
    "utilization_curves",
    "request_timeline",
    "latency_distributions",
    "curves",
    "bars",
    "request_colors",
    "step_through",
    "KINDS",
    "block_kinds",
    "count_kinds",
    "fork_map",
    "engine_core_processes",
    "engine_loop_timeline",
    "experts_touched",
    "moe_roofline",
    "expert_load_map",
    "expert_step",
    "expert_step_through",
    "rank_load",
]

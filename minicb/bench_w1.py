"""Moved to minicb.bench.w1 (and minicb.bench.machine); this alias goes once the notebooks import the new path."""
from .bench.machine import PeakRSS, cpu_model  # noqa: F401
from .bench.w1 import *  # noqa: F401,F403
from .bench.w1 import COMPETITORS, decode_step_roofline, print_w1, run_w1, w1_figure, w1_workload  # noqa: F401
from .cpu_kernels import gemm_peaks  # noqa: F401

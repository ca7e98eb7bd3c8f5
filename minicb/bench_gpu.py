"""Moved to minicb.bench.w2; this alias goes once the notebooks import the new path."""
from .bench.w2 import *  # noqa: F401,F403
from .bench.w2 import decode_latency_by_bucket, run_w2, w2_workload  # noqa: F401

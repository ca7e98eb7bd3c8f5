"""minicb: a small continuous-batching LLM inference engine, written to be read.

The pure-Python core (config, request, sampling_params, block_manager, scheduler, scheduler_output,
trace, sim) imports no torch; `LLM` and `Engine` (the torch side) are imported on first use, so that
`from minicb.sim import simulate` works in milliseconds without a model.
"""

from .config import EngineConfig
from .core.request import RequestStatus
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "Engine",
    "EngineConfig",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestStatus",
]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "BeamSearchParams":  # vLLM's LLM.beam_search parameters
        from .engine.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "Engine":
        from .engine.llm_engine import Engine

        return Engine
    raise AttributeError(f"module 'minicb' has no attribute {name!r}")

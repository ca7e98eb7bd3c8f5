"""minicb: a small continuous-batching LLM inference engine, written to be read.

The pure-Python core (config, request, sampling, block_manager, scheduler, trace, sim) imports
no torch; `LLM` and `Engine` (the torch side) are imported on first use, so that
`from minicb.sim import simulate` works in milliseconds without a model.
"""

from .config import EngineConfig
from .request import RequestOutput, RequestStatus
from .sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestStatus"]
__version__ = "0.1.0"


def __getattr__(name):
    if name in ("LLM", "Engine"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'minicb' has no attribute {name!r}")

"""Shared test set-up: tiny models run fastest on one thread (no OpenMP spin on a busy machine)."""

import gc

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _thaw_the_heap():
    """An engine freezes the heap when it is built (vLLM's freeze_gc_heap) and thaws it at shutdown:
    one that a test never shut down must not keep that test's objects for the rest of the run."""
    yield
    gc.unfreeze()

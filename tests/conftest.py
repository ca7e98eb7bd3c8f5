"""Shared test set-up: tiny models run fastest on one thread (no OpenMP spin on a busy machine)."""

import torch

torch.set_num_threads(1)

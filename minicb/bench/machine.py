"""What the machine is, measured: its CPU's name and vector units, peak memory while code runs, and
how firm a median of noisy runs is. (The matmul peaks of each CPU kernel are in
minicb/model_executor/cpu_kernels.py.)"""

import math
import os
import threading

# force torch's thread count in every notebook (CI runs learners with 1)
THREADS_ENV = "MINICB_NUM_THREADS"


def pin_torch_threads(wanted: int | None = None) -> int:
    """Set torch's thread count for a notebook that times something, and return it.

    torch's threads wait for one another at every operator, so a thread that another program keeps
    off its core slows every step: by default use the cores that are free now (all cores minus the
    load average), or `wanted` if the notebook asks for a number. MINICB_NUM_THREADS overrides both,
    so that CI can run every notebook on one thread and find any result that depends on it."""
    import torch

    forced = os.environ.get(THREADS_ENV)
    if forced:
        threads = int(forced)
    elif wanted is not None:
        threads = wanted
    else:
        busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        cores = os.cpu_count() or 1
        threads = max(1, min(cores, round(cores - busy)))
    torch.set_num_threads(threads)
    return threads


def cpu_model() -> str:
    """The CPU's name and vector units (AVX2 / AVX-512 / AMX), from /proc/cpuinfo (Linux)."""
    from ..model_executor.cpu_kernels import cpu_name

    return cpu_name()


class PeakRSS:
    """Peak resident memory above the starting point while the block runs (sampled every 20 ms)."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.mib = (self.peak - self.base) / 2**20


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """An interval that holds the median of the distribution `values` were drawn from, with
    probability at least `confidence`, whatever that distribution is (the runs need only be
    independent): the k-th smallest and the k-th largest value, with k the largest count for which
    fewer than k of n values fall below the median with probability at most (1 - confidence) / 2
    (a Binomial(n, 1/2) tail; the sign test's interval). None when there are too few values for
    any such k: fewer than 6 at 95%, fewer than 5 at 90%.

    On a VM whose speed moves 10-20% from one run to the next, one run's ratio says little; this
    says whether a target lies outside what the noise allows (serve/yardstick.py)."""
    n, tail = len(values), (1 - confidence) / 2
    k, below = 0, math.comb(n, 0) / 2**n  # below: P(fewer than k + 1 values below the median)
    while k < n and below <= tail:
        k += 1
        below += math.comb(n, k) / 2**n
    if k == 0:
        return None
    xs = sorted(values)
    return xs[k - 1], xs[n - k]

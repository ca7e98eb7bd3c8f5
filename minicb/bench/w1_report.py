"""W1's report: the table `python -m minicb bench --workload w1` prints, and its figure
(figures/bench_w1.png)."""

from ..model_executor.cpu_kernels import describe


def print_w1(report: dict, print_fn=print) -> None:
    ms = lambda x: f"{1000 * x:7.0f}"
    print_fn(
        f"\nW1 on {report['machine']}: {report['num_requests']} requests, "
        f"{report['prompt_tokens']} prompt and {report['output_tokens']} output tokens"
    )
    w = max([42] + [len(r["name"]) + 1 for r in report["results"]])
    print_fn(
        f"{'system':<{w}}{'tok/s':>8}{'wall s':>8}{'TTFT p50':>9}{'p99':>8}"
        f"{'TPOT p50':>9}{'p99':>8}"
        f"{'mem MiB':>8}{'slots':>7}{'of floor':>9}"
    )
    for r in report["results"]:
        util = f"{r['slot_utilization']:.0%}" if "slot_utilization" in r else "-"
        print_fn(
            f"{r['name']:<{w}}{r['throughput']:8.1f}{r['wall_s']:8.1f}{ms(r['ttft_p50'])}ms{ms(r['ttft_p99'])}"
            f"{ms(r['tpot_p50'])}ms{ms(r['tpot_p99'])}{r['peak_mem_mib']:8.0f}{util:>7}"
            f"{r['floor_fraction']:9.0%}"
        )
    f = report["floor"]
    print_fn(
        f"the machine's floor for W1: {f['floor_s']:.1f} s ({f['binding']} binds): compute "
        f"{f['flops']['total'] / 1e12:.2f} TFLOP / {f['gemm_peak_flops'] / 1e9:.0f} GFLOP/s = "
        f"{f['compute_s']:.1f} s; sequential {f['longest_output']} passes x "
        f"{f['weight_bytes'] / 1e6:.0f} MB of weights / {f['bandwidth'] / 1e9:.1f} GB/s = "
        f"{f['sequential_s']:.1f} s. 'of floor' = floor / wall time"
    )
    if "kernels" in f:
        k = f["kernels"]
        print_fn(
            f"the kernels' floor: W1's {k['passes']} forward passes batched as fully as it allows "
            "(prompts in passes of 512 tokens, then every unfinished request in every decode "
            "step), their linears alone on the kernels minicb calls, timed here: "
            f"{k['layers_s']:.1f} s of layers + {k['lm_head_s']:.1f} s of LM head = "
            f"{k['kernel_s']:.1f} s. Batched so, these kernels allow at most "
            f"{f['floor_s'] / k['kernel_s']:.0%} of the floor"
        )
        o = k["other"]
        print_fn(
            f"  the same rows over the {o['chain']} passes the longest request needs, arranged "
            "otherwise (estimates): one row in each but the first, the rest in full passes "
            f"{o['tail_s']:.1f} s; spread evenly {o['even_s']:.1f} s: at most "
            f"{f['floor_s'] / min(o['tail_s'], o['even_s']):.0%} of the floor either way"
        )
    for name, pf in report.get("floors", {}).items():
        if name != "float32":
            print_fn(
                f"  the floors for {name} (its bytes per weight, its GEMM peak "
                f"{pf['gemm_peak_flops'] / 1e9:.0f} GFLOP/s, its linears): the machine's "
                f"{pf['floor_s']:.1f} s ({pf['binding']} binds), the kernels' "
                f"{pf['kernels']['kernel_s']:.1f} s; rows in {name} are priced at these"
            )
    for r in report["results"]:
        if "accuracy" in r:
            a = r["accuracy"]
            div = ", ".join("-" if d is None else str(d) for d in a["first_divergence"])
            print_fn(
                f"accuracy of {r['name']} against float32: teacher-forced top-1 agreement "
                f"{a['top1']:.1%} over {a['positions']} positions (the first W1 prompts); "
                f"first divergence of the free-running outputs per prompt: [{div}]"
            )
    if report.get("llamacpp"):
        sweep = report["llamacpp"]
        print_fn(
            f"llama.cpp ({sweep['version']}, {sweep['server']}): the sweep, one W1 run each: "
            + "; ".join(f"{r['settings']} {r['throughput']:.0f} tok/s" for r in sweep["rows"])
            + f". Best: {sweep['best']['settings']}, run again after the cooldown as its row"
        )
    if report.get("cpu_kernels"):
        print_fn(
            "minicb's linears (chosen by timing on this machine): "
            f"{describe(report['cpu_kernels'])}"
        )
    by_key = {r.get("key"): r for r in report["results"]}
    minicb_rows = [r for r in report["results"] if r.get("key", "").startswith("minicb")]
    if "llamacpp" in by_key and minicb_rows:
        best = max(minicb_rows, key=lambda r: r["throughput"])
        print_fn(
            f"  minicb's best here ({best['name']}) vs llama.cpp's best setting "
            f"({by_key['llamacpp']['settings']}), same run: "
            f"{best['throughput'] / by_key['llamacpp']['throughput']:.2f}x"
        )
    for a, b, what in (
        ("minicb_continuous_16", "minicb_static", "continuous vs static batching, both 16 slots"),
        ("minicb_continuous", "minicb_continuous_16", "64 slots vs 16, both continuous"),
        ("minicb_continuous", "hf_continuous", "minicb vs transformers, continuous batching"),
        ("minicb_continuous", "hf_static", "minicb vs transformers' static generate"),
    ):
        if a in by_key and b in by_key:
            # against another system: the most any engine calling these kernels could reach, its
            # wall over the kernels' floor
            most = (
                " (batched as fully, these kernels allow at most "
                f"{by_key[b]['wall_s'] / f['kernels']['kernel_s']:.1f}x)"
                if b.startswith("hf_") and "kernels" in f
                else ""
            )
            print_fn(f"  {what}: {by_key[a]['throughput'] / by_key[b]['throughput']:.1f}x{most}")
    kernels = ", ".join(f"{k} {v:.0f}" for k, v in report.get("gemm_peaks", {}).items())
    print_fn(
        f"roofline: GEMM peak {report['gemm_peak_gflops']:.0f} GFLOP/s (float32, the best of: "
        f"{kernels}), {report['flops_per_token'] / 1e6:.0f} MFLOP per token (2 x params)"
    )
    for r in report["results"]:
        print_fn(
            f"  {r['name']:<42} {r['achieved_gflops']:6.1f} GFLOP/s = "
            f"{r['roofline_fraction']:.0%} of peak"
        )
    d = report["decode_step"]
    print_fn(
        f"  decode step at batch {d['batch']} (context {d['context']}): {d['step_ms']:.0f} ms, "
        f"{d['gflops']:.0f} GFLOP/s = {d['gflops'] / d['gemm_peak_gflops']:.0%} of the GEMM peak"
        + "".join(
            f" ({d['gflops'] / v:.0%} of {k})"
            for k, v in report.get("gemm_peaks", {}).items()
            if v < d["gemm_peak_gflops"]
        )
    )


def w1_figure(report: dict):
    """Throughput and latency of the W1 competitors, side by side (one shared row per system)."""
    import matplotlib.pyplot as plt

    rs = report["results"]
    names = [r["name"].replace(" (", "\n(") for r in rs]
    y = list(range(len(rs)))
    palette = dict(hf_static="#9e9e9e", hf_continuous="#616161", minicb_static="#64b5f6")
    palette |= dict(minicb_continuous_16="#1e88e5", minicb_continuous="#0d47a1")
    palette |= dict(minicb_auto="#6a1b9a", minicb_int8="#ad1457", llamacpp="#2e7d32")
    colors = [palette.get(r.get("key"), "#0d47a1") for r in rs]
    # the lines are float32's floors; a row in another precision is priced at its own (its label)
    which = " (float32)" if len(report.get("floors", {})) > 1 else ""
    fig, axes = plt.subplots(1, 3, figsize=(14, 0.9 * len(rs) + 1.8), sharey=True)
    axes[0].barh(y, [r["throughput"] for r in rs], color=colors)
    for i, r in enumerate(rs):
        of_floor = f" ({r['floor_fraction']:.0%} of floor)" if "floor_fraction" in r else ""
        axes[0].text(
            r["throughput"], i, f" {r['throughput']:.0f}{of_floor}", va="center", fontsize=9
        )
    if "floor" in report:  # the fastest any system could run W1 on this machine
        bound = report["output_tokens"] / report["floor"]["floor_s"]
        axes[0].axvline(bound, color="#c62828", linestyle="--")
        axes[0].text(
            bound,
            len(rs) - 0.5,
            f"the machine's floor{which}\n{bound:.0f} tok/s ",
            ha="right",
            va="top",
            color="#c62828",
            fontsize=8,
        )
    if "kernels" in report.get(
        "floor", {}
    ):  # the same, with the linears on the kernels minicb calls
        bound = report["output_tokens"] / report["floor"]["kernels"]["kernel_s"]
        axes[0].axvline(bound, color="#ef6c00", linestyle=":")
        axes[0].text(
            bound,
            -0.5,
            f"the kernels' floor{which}\n{bound:.0f} tok/s ",
            ha="right",
            va="bottom",
            color="#ef6c00",
            fontsize=8,
        )
    axes[0].set_xlabel("output tokens / s (higher is better)")
    axes[0].set_yticks(y, names)
    for ax, key, label, scale in (
        (axes[1], "ttft", "TTFT (s)", 1),
        (axes[2], "tpot", "TPOT (ms)", 1000),
    ):
        ax.barh(
            [i + 0.2 for i in y], [scale * r[f"{key}_p50"] for r in rs], height=0.4, color=colors
        )
        ax.barh(
            [i - 0.2 for i in y],
            [scale * r[f"{key}_p99"] for r in rs],
            height=0.4,
            color=colors,
            alpha=0.45,
        )
        ax.set_xlabel(f"{label}: p50 dark, p99 light (lower is better)")
    fig.suptitle(
        f"W1: {report['num_requests']} mixed-length chat requests, SmolLM2-135M, "
        f"{report['machine']}"
    )
    fig.tight_layout()
    return fig

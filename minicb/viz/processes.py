"""The server built like vLLM's, drawn: the API-server process, the engine-core process, and the
messages on the pipe between them (minicb/serve/engine_core.py, RemoteEngine and run_engine_core).

  API_SIDE, CORE_SIDE      what runs in each process: (name, what it does), drawn top to bottom
  MESSAGES                 every kind of message: (kind, the process that sends it, what it carries)
  engine_core_processes    the picture. Each box, arrow and label is an artist with a gid
                           ("process:api", "part:core:Scheduler", "message:step", ...), so a test
                           can read back on which side each part was drawn and which way each arrow
                           points.

The data is written here, not read from the server's code, so that drawing imports neither torch
nor the server; tests/test_viz.py checks MESSAGES against the kinds engine_core.py really sends.
"""

import textwrap

from matplotlib.patches import FancyBboxPatch

from .style import new_axes

API, CORE = "api", "core"
API_SIDE = [
    ("FastAPI / uvicorn", "HTTP and JSON in, server-sent events out"),
    ("InputProcessor", "tokenize, validate, make the samples of each request"),
    ("per-request streams", "the newest output of each request, per HTTP request"),
    (
        "engine loop + RemoteEngine",
        "a mirror of every request in flight, grown from the step messages",
    ),
    ("OutputProcessor", "detokenize, find stop strings, the text of logprobs"),
]
CORE_SIDE = [
    ("run_engine_core", "its main thread: take the messages, step while there is work"),
    ("Engine.add_samples", "admit the samples made in the API process"),
    ("Scheduler", "schedule() and update(): slots, KV blocks, preemption"),
    ("ModelRunner", "one forward pass over the batch, then the sampler"),
    ("Engine.step", "each sample's new token ids and finish reason, never text"),
]
MESSAGES = [  # (kind, sender, payload), in the order drawn, top to bottom
    ("add", API, "the samples: prompt token ids, SamplingParams, priority"),
    ("abort", API, "a request id: its client left"),
    ("stop", API, "a sample id: a stop string was found in its text"),
    ("shutdown", API, "the server is stopping"),
    ("ready", CORE, "once, at start: config, tokenizer, vocabulary size, KV stats"),
    (
        "step",
        CORE,
        "every step: per sample (new token ids, finish reason, logprobs, time); KV stats",
    ),
    ("stats", CORE, "KV stats, when an abort freed blocks while the core was idle"),
    ("error", CORE, "why the core failed (then the API process fails the requests in flight)"),
]
# blue: HTTP side, orange: engine side (as notebook 10's first picture)
COLORS = {API: "#c6dbef", CORE: "#fdd0a2"}
ARROWS = {API: "#2b6cb0", CORE: "#c05621"}


def engine_core_processes(
    api_pid: int | None = None, core_pid: int | None = None, title: str | None = None
):
    """Two process boxes and the messages between them; with pids, each box names its process id."""
    fig, ax, _ = new_axes(None, (14, 7.4))
    left, right, gap_left, gap_right, top, bottom = 0.0, 14.0, 4.6, 9.4, 9.0, 0.4
    _process(
        ax,
        API,
        (left, gap_left),
        (bottom, top),
        "API-server process",
        api_pid,
        "asyncio + threads, one GIL",
        API_SIDE,
    )
    _process(
        ax,
        CORE,
        (gap_right, right),
        (bottom, top),
        "engine-core process",
        core_pid,
        "spawned: its own interpreter and GIL",
        CORE_SIDE,
    )
    ax.text(
        (gap_left + gap_right) / 2,
        top - 0.15,
        "multiprocessing Pipe\n(pickled tuples)",
        ha="center",
        va="top",
        fontsize=9,
        style="italic",
        gid="label:pipe",
    )
    ys = [top - 1.35 - i * 0.88 for i in range(len(MESSAGES))]
    for (kind, sender, payload), y in zip(MESSAGES, ys):
        tail, head = (gap_left, gap_right) if sender == API else (gap_right, gap_left)
        ax.annotate(
            "",
            (head, y),
            (tail, y),
            gid=f"message:{kind}",
            arrowprops=dict(
                arrowstyle="-|>",
                lw=1.6 if kind == "step" else 1.1,
                color=ARROWS[sender],
                shrinkA=0,
                shrinkB=0,
            ),
        )
        ax.text(
            (gap_left + gap_right) / 2,
            y + 0.05,
            kind,
            ha="center",
            va="bottom",
            fontsize=9.5,
            fontweight="bold",
            color=ARROWS[sender],
            gid=f"label:{kind}",
        )
        ax.text(
            (gap_left + gap_right) / 2,
            y - 0.05,
            textwrap.fill(payload, 44),
            ha="center",
            va="top",
            fontsize=7,
            color="#333333",
            gid=f"payload:{kind}",
        )
    ax.text(
        (gap_left + gap_right) / 2,
        bottom + 0.05,
        "the pipe closes (EOFError): the core died.\nThe streams "
        "in flight get an error, /health answers 503.",
        ha="center",
        va="bottom",
        fontsize=7.5,
        color="#b22222",
        gid="label:death",
    )
    ax.set_xlim(left - 0.1, right + 0.1)
    ax.set_ylim(bottom - 0.1, top + 0.1)
    ax.axis("off")
    ax.set_title(
        title
        or "The engine core in its own process (python -m minicb serve): who does what, "
        "and what crosses the pipe",
        fontsize=11,
    )
    fig.tight_layout()
    return fig


def _process(
    ax,
    side: str,
    xs: tuple[float, float],
    ys: tuple[float, float],
    name: str,
    pid: int | None,
    note: str,
    parts: list[tuple[str, str]],
) -> None:
    """One process: a box with its name (and pid), and one smaller box per part, top to bottom."""
    (x0, x1), (y0, y1) = xs, ys
    ax.add_patch(
        FancyBboxPatch(
            (x0, y0),
            x1 - x0,
            y1 - y0,
            boxstyle="round,pad=0,rounding_size=0.15",
            facecolor="white",
            edgecolor="#555555",
            lw=1.5,
            gid=f"process:{side}",
        )
    )
    ax.text(
        (x0 + x1) / 2,
        y1 - 0.2,
        name + (f" (pid {pid})" if pid is not None else ""),
        ha="center",
        va="top",
        fontsize=10.5,
        fontweight="bold",
        gid=f"title:{side}",
    )
    ax.text(
        (x0 + x1) / 2,
        y1 - 0.6,
        note,
        ha="center",
        va="top",
        fontsize=8,
        style="italic",
        gid=f"note:{side}",
    )
    height = (y1 - y0 - 1.3) / len(parts)
    for i, (part, what) in enumerate(parts):
        top = y1 - 1.1 - i * height
        ax.add_patch(
            FancyBboxPatch(
                (x0 + 0.2, top - height + 0.12),
                x1 - x0 - 0.4,
                height - 0.24,
                boxstyle="round,pad=0,rounding_size=0.1",
                facecolor=COLORS[side],
                edgecolor="gray",
                gid=f"box:{side}:{part}",
            )
        )
        ax.text(
            (x0 + x1) / 2,
            top - height / 2 + 0.05,
            part,
            ha="center",
            va="bottom",
            fontsize=9,
            fontweight="bold",
            gid=f"part:{side}:{part}",
        )
        ax.text(
            (x0 + x1) / 2,
            top - height / 2 - 0.05,
            textwrap.fill(what, 44),
            ha="center",
            va="top",
            fontsize=8,
            gid=f"what:{side}:{part}",
        )

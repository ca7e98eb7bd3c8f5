"""Pictures of tensor parallelism (notebook 15): which rank owns which slice of each weight of one
decoder layer, and the bytes a ring all-reduce puts on each link. Plain numbers in, a Figure out."""

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from .style import new_axes


def tp_split(
    hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, n: int
):
    """One decoder layer's weights as (output features x input features) rectangles, each cut into
    the slices of n ranks: qkv and gate_up by output features (columns of the layer), o and down by
    input features (rows), then the all-reduce that adds the partial outputs. Norms, the embedding
    and the LM head are whole on every rank (not drawn)."""
    fig, ax = plt.subplots(figsize=(13, 4.6))
    plt.close(fig)
    colors = [plt.get_cmap("tab10")(r) for r in range(n)]
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    # name, out features, in features, how it is cut, the cut's pieces along out (per rank: q, k, v)
    mats = [
        ("qkv_proj", q + 2 * kv, hidden, "out", [q, kv, kv]),
        ("o_proj", hidden, q, "in", [q]),
        ("gate_up_proj", 2 * intermediate, hidden, "out", [intermediate, intermediate]),
        ("down_proj", hidden, intermediate, "in", [intermediate]),
    ]
    scale = 3.6 / max(m[1] for m in mats)
    x = 0.0
    for name, out_f, in_f, cut, parts in mats:
        w, h = in_f * scale, out_f * scale
        if cut == "out":  # every part (q, k, v or gate, up) is cut in n along its output features
            y = 0.0
            for part in parts:
                for r in range(n):
                    ax.add_patch(
                        Rectangle(
                            (x, y + r * part * scale / n),
                            w,
                            part * scale / n,
                            color=colors[r],
                            alpha=0.75,
                            ec="white",
                        )
                    )
                y += part * scale
        else:  # cut along input features: each rank holds a vertical band
            for r in range(n):
                ax.add_patch(
                    Rectangle((x + r * w / n, 0), w / n, h, color=colors[r], alpha=0.75, ec="white")
                )
        label = (
            f"{name}\n{out_f} x {in_f}\n"
            f"split by {'output (columns)' if cut == 'out' else 'input (rows)'}"
        )
        ax.text(x + w / 2, -0.25, label, ha="center", va="top", fontsize=8)
        if cut == "in":
            ax.annotate(
                "all-reduce", (x + w + 0.05, h / 2), fontsize=8, color="k", rotation=90, va="center"
            )
        x += w + 0.7
    for r in range(n):
        ax.add_patch(Rectangle((x, 3.2 - 0.35 * r), 0.3, 0.25, color=colors[r], alpha=0.75))
        ax.text(x + 0.4, 3.32 - 0.35 * r, f"rank {r}", va="center", fontsize=8)
    ax.text(
        x,
        3.2 - 0.35 * n,
        "not drawn, whole on every rank:\nnorms, embedding, LM head",
        fontsize=8,
        va="top",
        color="0.4",
    )
    ax.set(
        xlim=(-0.2, x + 2.2),
        ylim=(-1.3, 4.0),
        title=f"One decoder layer over {n} ranks: {num_heads} query heads, "
        f"{num_kv_heads} KV heads, {intermediate} MLP features",
    )
    ax.axis("off")
    return fig


def ring_bytes(sizes: list[int], payload: float = 1.0, ax=None):
    """Bytes each link carries for one ring all-reduce of `payload` bytes over n ranks: 2 (n - 1) /
    n x payload (a reduce-scatter, then an all-gather, each n - 1 steps of payload / n)."""
    fig, ax, own = new_axes(ax, (6, 3.6))
    ax.plot(sizes, [2 * (n - 1) / n * payload for n in sizes], "o-")
    ax.axhline(2 * payload, color="k", lw=1, ls="--")
    ax.text(sizes[-1], 2 * payload, "2 x payload", ha="right", va="bottom", fontsize=8)
    ax.set(
        xlabel="ranks n",
        ylabel="on each link (1 = the payload)" if payload == 1.0 else "bytes on each link",
        title="Ring all-reduce: per-link bytes barely grow with n",
        xticks=sizes,
        ylim=(0, 2.3 * payload),
    )
    ax.grid(alpha=0.3)
    if own:
        fig.tight_layout()
    return fig

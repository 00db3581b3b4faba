"""The latency plot: one panel per database, cumulative share of messages against latency."""

from __future__ import annotations

from typing import Any

from .contenders import BACKEND_LABEL, BACKENDS
from .metrics import ok_runs, pct
from .report import Results, ms


def plot(contenders: list[Any], results: Results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = results.get("latency", {})
    backends = [
        b
        for b in BACKENDS
        if any(c.backend == b and lat.get(c.key) for c in contenders if c.kind in ("ours", "firm"))
    ]
    if not backends:
        return
    fig, axes = plt.subplots(
        1, len(backends), figsize=(5.2 * len(backends), 5.4), sharey=True, squeeze=False
    )
    style = {
        "ours": dict(color="#1f6feb", lw=2.4, ls="-"),
        "firm100": dict(color="#d9534f", lw=1.6, ls="-"),
        "firm10": dict(color="#f0ad4e", lw=1.6, ls="-"),
        "redis": dict(color="#555555", lw=1.2, ls="--"),
        "pgnotify": dict(color="#555555", lw=1.2, ls=":"),
    }
    refs = [c for c in contenders if c.kind in ("redis", "pgnotify")]
    for ax, b in zip(axes[0], backends, strict=False):
        for c in [c for c in contenders if c.backend == b and c.kind in ("ours", "firm")] + refs:
            samples: list[float] = []
            for r in ok_runs(lat.get(c.key)):
                samples.extend(r["latencies"])
            if not samples:
                continue
            s = sorted(max(v, 0.01) for v in samples)
            y = [(i + 1) / len(s) for i in range(len(s))]
            sk = c.key.split("/")[0]
            ax.step(
                s, y, where="post", label=f"{c.label}, pooled p50 {ms(pct(s, 50))} ms", **style[sk]
            )
        ax.set_xscale("log")
        ax.set_title(BACKEND_LABEL[b])
        ax.set_xlabel("cross-process latency, ms (log)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    axes[0][0].set_ylabel("share of messages delivered within")
    fig.suptitle("Broadcast → callback in another process (all rounds pooled)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

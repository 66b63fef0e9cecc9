"""Tables and plots of results."""

from __future__ import annotations

from pathlib import Path


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """rows: dicts; columns: (key, header, format spec). Returns an aligned plain-text table."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([format(row[key], spec) if row.get(key) is not None else "-" for key, _, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if n and i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pyplot():
    """matplotlib.pyplot on the file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def plot_ppl(rows: list[dict], path: str | Path, title: str) -> Path:
    """Bar chart of perplexity relative to BF16 per method, with bits per element in the labels."""
    import matplotlib.ticker

    fig, ax = _pyplot().subplots(figsize=(6, 3.5))
    labels = [f"{r['method']}\n{r['bits_per_element']:.2f} b/elt" for r in rows]
    values = [r["ppl_ratio"] for r in rows]
    bars = ax.bar(labels, values, color=["#888" if r["method"] == "bf16" else "#3a7" for r in rows])
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_ylabel("perplexity / BF16 perplexity")
    ax.axhline(1.0, color="k", lw=0.8)
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:.3f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=8)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def plot_niah(rows: list[dict], path: str | Path, title: str) -> Path:
    """Exact-match accuracy vs prompt length, one line per method (all needles, and those in INT2)."""
    fig, axes = _pyplot().subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for key, ax, label in ((("accuracy", axes[0], "all needles")), ("history_accuracy", axes[1], "needles stored in INT2")):
        for method in dict.fromkeys(r["method"] for r in rows):
            points = sorted((r["length"], r[key]) for r in rows if r["method"] == method and r[key] is not None)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(label, fontsize=9)
        ax.set_ylim(-5, 105)
    axes[0].set_ylabel("exact match %")
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)

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


def plot_pass_rate(rows: list[dict], path: str | Path, title: str) -> Path:
    """Bar chart of HumanEval pass@1 per method."""
    fig, ax = _pyplot().subplots(figsize=(6, 3.5))
    bars = ax.bar([r["method"] for r in rows], [r["pass_at_1"] for r in rows],
                  color=["#888" if r["method"] == "bf16" else "#3a7" for r in rows])
    for bar, row in zip(bars, rows):
        ax.annotate(f"{row['passed']}/{row['problems']}", (bar.get_x() + bar.get_width() / 2, row["pass_at_1"]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("pass@1 %")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def _decode_path(settings: dict) -> str:
    """How the timed steps ran their small operations and linear layers (`bench decode`'s settings), as far as
    the saved settings say."""
    said = []
    small_ops, gemv = settings.get("compile_small_ops"), settings.get("decode_gemv")
    if small_ops is not None:
        said.append("small operations " + ("compiled" if small_ops else "eager (--eager-small-ops)"))
    if gemv is not None:
        said.append("linear layers by " + ("oscarkv's Triton kernels" if gemv else "cuBLAS (--cublas)"))
    return ", ".join(said)


def decode_tables(result: dict) -> str:
    """The `bench decode` results of one model as plain-text tables, BF16 and INT2 side by side."""
    def rows(entries: list[dict]) -> list[dict]:
        out = []
        for e in entries:
            bf16, int2 = e.get("bf16"), e.get("int2")
            row = {"context": e["context"], "ratio": e.get("throughput_ratio")}
            for name, run in (("bf16", bf16), ("int2", int2)):
                run = run or {}
                row.update({f"{name}_batch": run.get("batch"), f"{name}_ms": run.get("step_ms"),
                            f"{name}_tps": run.get("tokens_per_s"), f"{name}_roof": run.get("roofline_ms"),
                            f"{name}_frac": None if not run else 100 * run["roofline_fraction"]})
            out.append(row)
        return out

    columns = [("context", "context", "d")]
    for name, label in (("bf16", "BF16"), ("int2", "INT2")):
        columns += [(f"{name}_batch", f"{label} batch", "d"), (f"{name}_ms", f"{label} ms/step", ".2f"),
                    (f"{name}_tps", f"{label} tok/s", ".0f"), (f"{name}_roof", f"{label} roofline ms", ".2f"),
                    (f"{name}_frac", f"{label} % of roofline", ".0f")]
    columns.append(("ratio", "INT2/BF16 tok/s", ".2f"))
    parts = [f"{result['model']} on {result['device']}: copy bandwidth {result['copy_bandwidth_gbs']:.0f} GB/s, "
             f"weights read per step {result['weight_bytes'] / 1e9:.2f} GB"]
    path = _decode_path(result.get("settings") or {})
    if path:
        parts.append(f"both caches' steps: {path}")
    centered = (result.get("settings") or {}).get("centered")
    if centered is not None:
        parts.append("INT2 cache: " + ("an oscar artifact's centering, keys with RoPE-following shifts (--centered)"
                                       if centered else "the hadamard method, no centering (without --centered)"))
    for key, title in (("single", "batch 1"), ("equal_memory", "equal KV memory (the INT2 cache of the INT2 batch)"),
                       ("largest", "the largest batch that fits")):
        if result.get(key):
            parts += ["", title, format_table(rows(result[key]), columns)]
    if result.get("prefill"):
        p = result["prefill"]
        parts += ["", f"prefill of {p['bf16']['tokens']} tokens: BF16 {p['bf16']['ms']:.0f} ms, INT2 "
                      f"{p['int2']['ms']:.0f} ms ({p['ratio']:.2f}x the BF16 time)"]
    if result.get("bits"):
        b = result["bits"]
        parts.append(f"INT2 cache of one {b['context']}-token sequence: {b['allocated_bytes'] / 2**20:.1f} MiB "
                     f"allocated = {b['bits_per_element']:.3f} bits per K/V element (group {b['group_size']})"
                     + (f"; {b['bits_per_element_unshared']:.3f} without the {b['shared_bytes'] / 2**20:.1f} MiB of "
                        "key-shift tables that all sequences share" if b.get("shared_bytes") else ""))
    parts += [f"skipped: {s}" for s in result.get("skipped", [])]
    return "\n".join(parts)


def plot_decode(results: list[dict], path: str | Path) -> Path:
    """Batch-1 decode tokens/s vs context, BF16 and INT2, one panel per model."""
    fig, axes = _pyplot().subplots(1, len(results), figsize=(4.5 * len(results), 3.5), squeeze=False)
    for ax, result in zip(axes[0], results):
        for name, label, color in (("bf16", "BF16 cache", "#888"), ("int2", "INT2 cache (oscarkv)", "#3a7")):
            points = [(e["context"], e[name]["tokens_per_s"]) for e in result["single"] if e.get(name)]
            ax.plot([p[0] / 1000 for p in points], [p[1] for p in points], marker="o", label=label, color=color)
            roof = [(e["context"], 1e3 / e[name]["roofline_ms"]) for e in result["single"] if e.get(name)]
            ax.plot([p[0] / 1000 for p in roof], [p[1] for p in roof], ls=":", color=color,
                    label=f"{label.split(' (')[0]} byte roofline")
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("decode tokens/s (batch 1)")
        ax.set_title(f"{result['model']}, {result['device']}", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    return _save(fig, path)

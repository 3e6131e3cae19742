"""``bench --report DIR``: the results as JSON, PNG plots and a short Markdown summary."""

from __future__ import annotations

from pathlib import Path

from ..core.format import write_json_atomic


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--report needs matplotlib: pip install 'mlx-streaming[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(r: dict) -> str:
    return f"{r['budget_gb']} GB" if r.get("budget_gb") else f"{r['per_layer_slots']} slots"


def write_report(results: list[dict], out_dir: str | Path) -> list[Path]:
    """Write results.json, plots and summary.md for one or more bench results."""
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "results.json"]
    write_json_atomic(files[0], results)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in results:
        layers = sorted(r["layers"], key=int)
        ax.plot(
            [int(li) for li in layers],
            [r["layers"][li]["hit_rate"] for li in layers],
            marker=".",
            label=_label(r),
        )
    ax.set(xlabel="layer", ylabel="hit rate", ylim=(0, 1.02), title="hit rate per MoE layer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files.append(_save(fig, out / "hit_rate_per_layer.png"))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        layers = sorted(r["layers"], key=int)
        tok = max(1, r["generated_tokens"] + r["prompt_tokens"])
        ax.bar(
            [int(li) + i * width for li in layers],
            [r["layers"][li]["bytes_read"] / tok / 1e6 for li in layers],
            width=width,
            label=_label(r),
        )
    ax.set(xlabel="layer", ylabel="MB read per token", title="bytes read per token, by layer")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    files.append(_save(fig, out / "bytes_read_per_token.png"))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in results:
        s = r.get("memory_series") or []
        if s:
            ax.plot([p[0] for p in s], [p[1] / 1e9 for p in s], label=f"RSS, {_label(r)}")
            ax.plot(
                [p[0] for p in s],
                [p[2] / 1e9 for p in s],
                linestyle="--",
                label=f"MLX active, {_label(r)}",
            )
    ax.set(xlabel="seconds (timed runs)", ylabel="GB", title="memory over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    files.append(_save(fig, out / "memory_over_time.png"))

    if len(results) > 1:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        xs = [r["pool_gb"] for r in results]
        ax.plot(xs, [r["tok_per_s"] for r in results], marker="o", label="streamed tok/s")
        if all("stock_tok_per_s" in r for r in results):
            ax.axhline(
                results[0]["stock_tok_per_s"],
                color="gray",
                linestyle="--",
                label="stock mlx-lm (all resident)",
            )
        ax2 = ax.twinx()
        ax2.plot(
            xs,
            [r["expert_hit_rate"] for r in results],
            color="tab:green",
            marker="x",
            label="hit rate",
        )
        ax.set(xlabel="expert pools (GB)", ylabel="tok/s", title="speed against budget")
        ax2.set_ylabel("hit rate")
        ax.grid(alpha=0.3)
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="lower right")
        files.append(_save(fig, out / "tok_per_s_vs_budget.png"))

    lines = [
        "# mlx_streaming bench report",
        "",
        f"Model `{results[0]['model']}`, {results[0]['patched_moe_layers']} MoE layers, "
        f"{results[0]['num_experts']} experts (top-{results[0]['top_k']}), device "
        f"{results[0]['device']}.",
        "",
        "| pools | GB | tok/s | decode tok/s | hit rate | MB read/token | peak RSS GB "
        "| vs stock | exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {_label(r)} | {r['pool_gb']} | {r['tok_per_s']} | {r['decode_tok_per_s']} | "
            f"{r['expert_hit_rate']} | {r['bytes_read_per_token'] / 1e6:.2f} | "
            f"{r['peak_rss_gb']} | {r.get('ratio_vs_stock', '-')} | "
            f"{r.get('exact_vs_stock', '-')} |"
        )
    lines += ["", "Plots: " + ", ".join(f"`{f.name}`" for f in files[1:]), ""]
    (out / "summary.md").write_text("\n".join(lines))
    files.append(out / "summary.md")
    return files


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path

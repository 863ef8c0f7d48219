"""The run's HTML report: one self-contained file (the plot is inline SVG)."""

from __future__ import annotations

import html
import io
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _plot_svg(steps: list[dict[str, Any]]) -> str:
    xs = [s["step"] for s in steps]
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.plot(xs, [s["mean_reward"] for s in steps], marker="o", color="tab:blue", label="mean reward")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward", color="tab:blue")
    ax.set_xticks(xs)
    twin = ax.twinx()
    twin.plot(xs, [s["mean_turns"] for s in steps], marker="s", color="tab:orange", label="mean turns")
    twin.set_ylabel("mean turns", color="tab:orange")
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _ledger_rows(book: dict[str, Any]) -> list[list[Any]]:
    rows = [[k.replace("_", " "), v] for k, v in book.items() if k != "saved"]
    return rows + [[f"saved: {k.replace('_', ' ')}", v] for k, v in book["saved"].items()]


def write_report(
    path: Path, summary: dict[str, Any], run: Any, attempts: list[dict[str, Any]], steps: list[dict[str, Any]]
) -> None:
    """Write the report of one run to `path`."""
    step_rows = [
        [
            s["step"],
            f"{s['n_trials']}/{s['n_specs']}",
            s["mean_reward"],
            s["mean_turns"],
            f"v{s['weights_version']}",
            f"{s['wall_s']:.2f}",
            s["driver_attempt"],
            ", ".join(sorted(s["failed_trials"])) or "-",
        ]
        for s in steps
    ]
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.started_at)) if run.started_at else "-"
    config = ", ".join(f"{k}={v}" for k, v in run.config.items())
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>durable-rl run {html.escape(run.run_id)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:60em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:right}}th{{background:#f3f3f3}}</style></head>
<body><h1>run {html.escape(run.run_id)}: {html.escape(summary["status"])}</h1>
<p>started {started} (durable: the same on every driver attempt) ·
driver attempts {len(attempts)}</p>
<p><small>{html.escape(config)}</small></p>
<h2>steps</h2>
{_table(["step", "trials", "mean reward", "mean turns", "weights", "wall s", "driver attempt", "skipped"], step_rows)}
<h2>mean reward and mean turns per step</h2>
{_plot_svg(steps) if steps else "<p>no step completed</p>"}
<h2>counters</h2>
{_table(["counter", "value"], [[k, v] for k, v in summary["counters"].items()])}
<h2>judge ledger</h2>
{_table(["", "value"], _ledger_rows(summary["ledger"]))}
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(page)
    tmp.replace(path)

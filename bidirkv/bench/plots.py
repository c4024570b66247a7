"""The two figures of the published benchmark, from compare() rows.

1. TTFT vs context length, ON / OFF / lower bound.
2. Prefill duration per turn, ON and OFF side by side, stacked: P's compute, the KV read
   from D, and the rest of the prefill leg (HTTP, queueing, scheduling).
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    return plt


def save(plt, fig, path: pathlib.Path) -> pathlib.Path:
    """Lay out, write (creating the folder) and close a figure."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _ms(v: float | None) -> float:
    return (v or 0.0) * 1000


def ttft_plot(rows: Sequence[Mapping[str, Any]], path: pathlib.Path, title: str) -> pathlib.Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    # A server that reports no usage leaves the turn number as the only x there is.
    by_context = all(r.get("context_tokens") is not None for r in rows)
    xs = [r["context_tokens"] if by_context else r["turn"] for r in rows]
    for key, label, style in (("ttft_off_s", "bidirectional OFF (recompute)", "o-"),
                              ("ttft_on_s", "bidirectional ON (read from D)", "s-"),
                              ("ttft_cost_s", "ON, placement cost (extend on D when cheaper)",
                               "d-"),
                              ("lower_bound_s", "lower bound (warm local cache)", "^--")):
        pts = [(x, r[key] * 1000) for x, r in zip(xs, rows, strict=True)
               if r.get(key) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax.set_xlabel("context length (prompt tokens)" if by_context else "turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save(plt, fig, path)


def prefill_plot(rows: Sequence[Mapping[str, Any]], path: pathlib.Path, title: str
                 ) -> pathlib.Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    width = 0.38
    xs = list(range(len(rows)))
    parts = (("compute", "P compute", "#4c72b0"), ("transfer", "KV read D->P", "#dd8452"),
             ("other", "rest of prefill leg", "#b0b0b0"))
    for side, offset, hatch in (("on", -width / 2, ""), ("off", width / 2, "//")):
        bottom = [0.0] * len(rows)
        for key, label, color in parts:
            vals = [_ms(r.get(f"{key}_{side}_s")) for r in rows]
            if not any(vals):
                continue  # e.g. no KV read with the flag off: no empty legend entry
            ax.bar([x + offset for x in xs], vals, width, bottom=bottom, color=color,
                   hatch=hatch, edgecolor="white", label=f"{label} ({side.upper()})")
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        if side == "on":
            # The read is milliseconds against seconds of compute: say it in numbers.
            for x, b, r in zip(xs, bottom, rows, strict=True):
                if r.get("transfer_on_s"):
                    ax.annotate(f"{r['transfer_on_s'] * 1000:.0f}", (x + offset, b),
                                textcoords="offset points", xytext=(0, 2), ha="center",
                                fontsize=7, color="#dd8452")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{r['turn']}\n{(r.get('context_tokens') or 0) / 1000:.1f}k"
                        for r in rows])
    ax.set_xlabel("turn / context tokens (left bar ON, right bar OFF; "
                  "orange numbers: ms of KV read D->P)")
    ax.set_ylabel("prefill duration (ms)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return save(plt, fig, path)


def long_plot(rows: Sequence[Mapping[str, Any]], restart: Mapping[str, Any] | None,
              path: pathlib.Path, title: str) -> pathlib.Path:
    """TTFT (s) vs context of the long-context phase: ON, OFF and the bound over the
    growing turns, and the short turns before and after the router restart as points."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for key, label, style in (("ttft_off_s", "bidirectional OFF (recompute)", "o-"),
                              ("ttft_on_s", "bidirectional ON (read from D)", "s-"),
                              ("lower_bound_s", "lower bound (warm local cache)", "^--")):
        pts = [(r["context_tokens"] / 1000, r[key]) for r in rows
               if r.get(key) is not None and r.get("context_tokens")]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    if restart is not None and restart.get("context_tokens"):
        before = (restart.get("context_before_tokens") or restart["context_tokens"]) / 1000
        ax.plot([before], [restart["ttft_before_s"]], "D", color="#55a868",
                label="ON, short append, before a router restart")
        ax.plot([restart["context_tokens"] / 1000], [restart["ttft_after_s"]], "*",
                color="#c44e52", markersize=12, label="ON, the same append after the restart")
    ax.set_xlabel("context length (thousand prompt tokens)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(plt, fig, path)


def agents_plot(rows: Sequence[Mapping[str, Any]], path: pathlib.Path, title: str
                ) -> pathlib.Path:
    """Median TTFT per kind of request of the agent trace: ON, OFF and the bound side by
    side, each kind's median shared tokens under its name."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    width = 0.27
    xs = list(range(len(rows)))
    for i, (key, label, color) in enumerate((
            ("ttft_on_s", "bidirectional ON (cost placement)", "#4c72b0"),
            ("ttft_off_s", "bidirectional OFF (recompute)", "#dd8452"),
            ("lower_bound_s", "lower bound (warm local cache)", "#55a868"))):
        ax.bar([x + (i - 1) * width for x in xs], [_ms(r.get(key)) for r in rows], width,
               color=color, label=label)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{r['kind']}\n{(r.get('shared_tokens') or 0) / 1000:.1f}k shared"
                        for r in rows], fontsize=8)
    ax.set_ylabel("median TTFT (ms)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    # Headroom above the tallest bar: the legend goes there, not over a bar.
    ax.set_ylim(top=ax.get_ylim()[1] * 1.2)
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    return save(plt, fig, path)

"""The drop-vs-drain benchmark's figure: TTFT of every turn over the run's time, one
panel per mode, each event marked where it fired, a turn that reused apart from one that
recomputed its history."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from bidirkv.bench.plots import _pyplot, save
from bidirkv.bench.turns import REUSED

EVENT_COLORS = ("#c44e52", "#8172b2", "#937860")


def ttft_timeline(runs: Mapping[str, Mapping[str, Any]], modes: Sequence[str],
                  path: pathlib.Path, title: str) -> pathlib.Path:
    plt = _pyplot()
    shown = [m for m in modes if m in runs]
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 2.8 * len(shown) + 0.6),
                             sharey=True, squeeze=False)
    for ax, mode in zip(axes[:, 0], shown, strict=True):
        recs = runs[mode]["records"]
        for label, pick, style in (
                ("reused (read from D or extended on D)", lambda r: r.get("reason") in REUSED,
                 dict(marker="o", color="#4c72b0")),
                ("recomputed (first turn or nothing held)",
                 lambda r: r.get("reason") not in REUSED, dict(marker="x", color="#dd8452"))):
            pts = [(r["at_s"], r["ttft_s"] * 1000) for r in recs if pick(r)]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=16, label=label,
                           **style)
        for i, ev in enumerate(runs[mode]["events"]):
            color = EVENT_COLORS[i % len(EVENT_COLORS)]
            ax.axvline(ev["at_s"], color=color, linestyle="--", linewidth=1.2,
                       label=ev["event"]["name"])
            if ev.get("stop_s") is not None and ev["event"]["target"] != "router":
                # How long the server took to go: the drain, or an instant kill.
                ax.axvspan(ev["at_s"], ev["at_s"] + ev["stop_s"], color=color, alpha=0.12)
        ax.set_title(f"{mode}: " + ("SIGTERM, decode drains first" if mode == "drain"
                                    else "SIGKILL, nothing drains" if mode == "drop"
                                    else "no event"), fontsize=10)
        ax.set_ylabel("TTFT (ms)")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the first request (shaded: the server stopping)")
    axes[0, 0].legend(fontsize=7, loc="upper center", ncol=2)
    fig.suptitle(title, fontsize=11)
    return save(plt, fig, path)

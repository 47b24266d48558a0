"""Drawing the charts of `expr plot`: plotext in the terminal, matplotlib (Agg) for files.

A chart is a list of panels, one per metric; a panel holds lines (one per rank, or the
median and the outlier ranks) and an optional p05-p95 band. Without colour (`NO_COLOR`, a
pipe) every line gets its own marker so that the legend still tells them apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from expr_cli.data.series import Band as Band
from expr_cli.data.series import Line as Line
from expr_cli.data.series import Panel as Panel

MARKERS = "ox+*#@%&=~"
OUTLIER_COLORS = ("tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink")


def _thin(steps: Sequence[int], values: Sequence[float], points: int) -> tuple[list[int], list[float]]:
    """At most `points` points for a terminal: bucket means of equal-count buckets."""
    n = len(steps)
    if n <= points:
        return list(steps), list(values)
    xs: list[int] = []
    ys: list[float] = []
    for b in range(points):
        lo, hi = b * n // points, (b + 1) * n // points
        if hi > lo:
            xs.append(steps[(lo + hi - 1) // 2])
            ys.append(sum(values[lo:hi]) / (hi - lo))
    return xs, ys


def _last(panel: Panel, pick: Any) -> float:
    steps = [s for line in panel.lines for s in line.steps[-1:]]
    return float(pick(steps)) if steps else 0.0


def _top(panel: Panel) -> float:
    tops = [max(line.values) for line in panel.lines if line.values]
    if panel.band is not None and panel.band.hi:
        tops.append(max(panel.band.hi))
    return max(tops) if tops else 0.0


def terminal(title: str, panels: Sequence[Panel], width: int, height: int, color: bool) -> str:
    """The chart as text for a terminal `width` x `height` cells."""
    from plotext import figure

    figure.clear()
    figure.plot_size(width, height)
    if len(panels) > 1:
        figure.subplots(len(panels), 1)
    points = max(2 * width, 20)
    for i, panel in enumerate(panels):
        plot = figure.subplot(i + 1, 1) if len(panels) > 1 else figure
        plot.theme("simple" if color else "colorless")
        plot.title(f"{title}  {panel.metric}" + (f"  ({panel.note})" if panel.note else ""))
        plot.label("step", axis="x")
        # top right: training curves mostly fall, so the corner is usually empty
        plot.legend(x=_last(panel, max), y=_top(panel), ha="right", va="top", relative=True)
        marker_at = 0
        if panel.band is not None:
            for name, ys in (("p05", panel.band.lo), ("p95", panel.band.hi)):
                xs, ys = _thin(panel.band.steps, ys, points)
                plot.draw(plot.signal(xs, ys, marker="." if not color else "dot").lines().label(name))
        # the median last, so that no outlier line covers it
        for line in sorted(panel.lines, key=lambda line: line.kind == "median"):
            xs, ys = _thin(line.steps, line.values, points)
            if not xs:
                continue
            if color:
                sig = plot.signal(xs, ys)
            else:
                sig = plot.signal(xs, ys, marker=MARKERS[marker_at % len(MARKERS)])
                marker_at += 1
            plot.draw(sig.lines().label(line.label))
    text: str = figure.build().string(colorless=not color)
    figure.clear()
    return text


def image(title: str, panels: Sequence[Panel], path: Path) -> None:
    """The chart as a PNG or SVG file (matplotlib, Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.6 * len(panels) + 0.6), sharex=True,
                             squeeze=False)
    try:
        for ax, panel in zip(axes[:, 0], panels, strict=True):
            _draw_panel(ax, panel)
        axes[-1, 0].set_xlabel("step")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, format=path.suffix.lstrip(".").lower(), dpi=110)
    finally:
        plt.close(fig)


def _draw_panel(ax: Any, panel: Panel) -> None:
    if panel.band is not None:
        ax.fill_between(panel.band.steps, panel.band.lo, panel.band.hi, alpha=0.25,
                        color="tab:blue", linewidth=0, label="p05-p95")
    others = iter(OUTLIER_COLORS)
    for line in panel.lines:
        if line.kind == "median":
            ax.plot(line.steps, line.values, color="tab:blue", linewidth=2, label=line.label)
        elif line.kind == "outlier":
            ax.plot(line.steps, line.values, color=next(others, None), linewidth=1.2, label=line.label)
        else:
            ax.plot(line.steps, line.values, linewidth=1.2, label=line.label)
    ax.set_title(panel.metric + (f"  ({panel.note})" if panel.note else ""), fontsize=10, loc="left")
    ax.grid(True, alpha=0.3)
    if panel.lines or panel.band:
        ax.legend(fontsize=8, loc="best", ncol=2 if len(panel.lines) > 6 else 1)

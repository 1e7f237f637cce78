"""Charts drawn on the server as inline SVG: no script draws them, and a refresh of the
overview replaces them whole. Colours and fonts come from the stylesheet (classes), so the
SVG carries no ``style`` attribute for the Content-Security-Policy to refuse."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence

from .html import Markup, render, tag

WIDTH = 360
HEIGHT = 120
_LEFT = 40
_TOP = 8
_BOTTOM = 18
_PLOT_W = WIDTH - _LEFT - 6
_PLOT_H = HEIGHT - _TOP - _BOTTOM


def _frame(title: str, top_label: str, minutes: Sequence[datetime.datetime],
           *content: Markup) -> Markup:
    first, last = minutes[0], minutes[-1]
    return tag(
        "svg", tag("title", title),
        tag("line", x1=_LEFT, y1=_TOP + _PLOT_H, x2=_LEFT + _PLOT_W, y2=_TOP + _PLOT_H,
            class_="axis"),
        tag("line", x1=_LEFT, y1=_TOP, x2=_LEFT, y2=_TOP + _PLOT_H, class_="axis"),
        tag("text", top_label, x=_LEFT - 4, y=_TOP + 8, class_="label end"),
        tag("text", "0", x=_LEFT - 4, y=_TOP + _PLOT_H, class_="label end"),
        tag("text", first.strftime("%H:%M"), x=_LEFT, y=HEIGHT - 4, class_="label"),
        tag("text", last.strftime("%H:%M UTC"), x=_LEFT + _PLOT_W, y=HEIGHT - 4,
            class_="label end"),
        *content,
        viewBox=f"0 0 {WIDTH} {HEIGHT}", width=WIDTH, height=HEIGHT, role="img",
        aria_label=title, class_="chart")


def bars(title: str, minutes: Sequence[datetime.datetime], values: Sequence[int]) -> Markup:
    """One bar per minute; each bar's tooltip says its minute and value."""
    top = max(values, default=0)
    scale = _PLOT_H / top if top else 0.0
    step = _PLOT_W / len(minutes)
    drawn = []
    for index, (minute, value) in enumerate(zip(minutes, values, strict=True)):
        if not value:
            continue
        height = max(1.0, value * scale)
        drawn.append(tag(
            "rect", tag("title", f"{minute:%H:%M} UTC: {value}"),
            x=f"{_LEFT + index * step + 0.5:.1f}", y=f"{_TOP + _PLOT_H - height:.1f}",
            width=f"{max(1.0, step - 1):.1f}", height=f"{height:.1f}", class_="bar"))
    return _frame(title, str(top), minutes, render(drawn))


def lines(title: str, minutes: Sequence[datetime.datetime],
          series: Mapping[str, Sequence[float | None]], unit: str) -> Markup:
    """One line per series (a gap where a minute has no value), with a legend."""
    top = max((value for values in series.values() for value in values if value is not None),
              default=0.0)
    scale = _PLOT_H / top if top else 0.0
    step = _PLOT_W / len(minutes)
    drawn = []
    for number, (name, values) in enumerate(series.items()):
        runs: list[list[str]] = [[]]
        for index, value in enumerate(values):
            if value is None:
                runs.append([])
                continue
            x = _LEFT + (index + 0.5) * step
            y = _TOP + _PLOT_H - value * scale
            runs[-1].append(f"{x:.1f},{y:.1f}")
        for run in runs:
            if len(run) == 1:
                cx, cy = run[0].split(",")
                drawn.append(tag("circle", cx=cx, cy=cy, r="1.5", class_=f"series{number}"))
            elif run:
                drawn.append(tag("polyline", points=" ".join(run), class_=f"series{number}"))
        drawn.append(tag("text", name, x=_LEFT + 8 + 36 * number, y=_TOP + 8,
                         class_=f"label legend{number}"))
    return _frame(title, f"{top:.0f} {unit}", minutes, render(drawn))

"""Grouped bar charts as PNG for the WAN benchmarks, drawn with the fault benchmarks' zlib canvas.

matplotlib is not a dependency of the project, and these figures need only bars and guide lines; like
the fault benchmarks' figures they carry no text, so each report's markdown gives the legend.
"""

from __future__ import annotations

from pathlib import Path

from bench.faults.common import PALETTE, Canvas, Colour

SERIES_COLOURS: list[Colour] = [PALETTE["blue"], PALETTE["orange"], PALETTE["green"], PALETTE["purple"]]
_GROUP_PX = 140
_HEIGHT_PX = 260
_MARGIN_PX = 24


def grouped_bars(
    path: Path,
    groups: list[list[float | None]],
    *,
    y_min: float,
    y_max: float,
    guides: list[tuple[float, Colour]],
) -> None:
    """One group of bars per entry of ``groups``, series coloured by :data:`SERIES_COLOURS`.

    A value of None (nothing measured, e.g. an unsupported setting) is drawn as a short grey stub, so a
    missing bar is never mistaken for a zero. Values are clipped to ``[y_min, y_max]``.
    """
    width = _MARGIN_PX * 2 + _GROUP_PX * max(1, len(groups))
    canvas = Canvas(width, _HEIGHT_PX)
    top, bottom = _MARGIN_PX // 2, _HEIGHT_PX - _MARGIN_PX

    def y_px(value: float) -> int:
        clipped = min(max(value, y_min), y_max)
        return round(bottom - (clipped - y_min) / (y_max - y_min) * (bottom - top))

    for value, colour in guides:
        canvas.line(_MARGIN_PX, y_px(value), width - _MARGIN_PX, y_px(value), colour)
    for g, series in enumerate(groups):
        bar = (_GROUP_PX - 20) // max(1, len(series))
        for s, value in enumerate(series):
            x0 = _MARGIN_PX + g * _GROUP_PX + 10 + s * bar
            if value is None:
                canvas.rect(x0 + 2, bottom - 3, x0 + bar - 3, bottom, PALETTE["grey"])
            else:
                canvas.rect(
                    x0 + 2, y_px(value), x0 + bar - 3, bottom, SERIES_COLOURS[s % len(SERIES_COLOURS)]
                )
    canvas.line(_MARGIN_PX, bottom, width - _MARGIN_PX, bottom, PALETTE["black"])
    canvas.line(_MARGIN_PX, top, _MARGIN_PX, bottom, PALETTE["black"])
    canvas.save(path)

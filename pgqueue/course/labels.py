"""Labels for the course's timelines that never overlap: each tries its slots beside its
point (above or below the lane, right or left of the point), then a short form, and is
left out rather than drawn over another label, a marker, a bar, a line or the axes edge."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_LABEL = {"fontsize": 8}
_GAP = 5.0  # points kept clear between two labels side by side, so they never read as one
_BAR = 0.14  # half the height of a hold bar, in lanes (timeline_bars.py draws the bars with it)


class _Labels:
    """Text labels placed beside their points so that none overlaps another label, a
    marker, a bar, a line registered as an obstacle, or leaves the axes (the legend sits
    outside them). Each label tries its slots in order (above or below the lane, running
    right or, near the right edge, left of its point), then its short form; a label that
    fits nowhere is left out rather than drawn over something."""

    def __init__(self, ax: Axes) -> None:
        self.ax = ax
        self.wanted: list[tuple[int, float, float, list[str], str, bool, dict[str, Any]]] = []
        self.obstacles: list[tuple[str, tuple[float, ...]]] = []
        self.fixed: list[Any] = []
        self.dropped: list[str] = []
        self.placed: list[Any] = []  # the labels drawn so far, as padded boxes

    def add(
        self,
        x: float,
        y: float,
        text: str,
        *,
        short: str | None = None,
        side: str = "above",
        priority: int = 2,
        stay_right: bool = False,
        **style: Any,
    ) -> None:
        """A label for the point (x, y). ``side``: try above or below the lane first.
        ``stay_right``: rather the short form right of the point than the long one left."""
        texts = [text] if short is None else [text, short]
        self.wanted.append((priority, x, y, texts, side, stay_right, _LABEL | style))

    def block(self, x0: float, x1: float, y0: float, y1: float) -> None:
        """A rectangle in data coordinates (a bar, a band) that labels must not cover."""
        self.obstacles.append(("rect", (x0, x1, y0, y1)))

    def block_point(self, x: float, y: float, size: float) -> None:
        """A marker of ``size`` points across at (x, y)."""
        self.obstacles.append(("point", (x, y, size)))

    def block_vline(self, x: float, y0: float, y1: float, width: float = 3.0) -> None:
        """A vertical line (an expiry mark, an arrow) ``width`` points wide."""
        self.obstacles.append(("vline", (x, y0, y1, width)))

    def keep(self, artist: Any) -> None:
        """A text already drawn where it must stay."""
        self.fixed.append(artist)

    def place(self) -> None:
        """Draw every label (most important first, then left to right) where it fits."""
        from matplotlib.transforms import Bbox

        ax = self.ax
        fig = ax.figure
        renderer = fig.canvas.get_renderer()
        px = fig.dpi / 72.0
        data = ax.transData

        def rect(x0: float, x1: float, y0: float, y1: float) -> Bbox:
            return Bbox.from_extents(*data.transform((x0, y0)), *data.transform((x1, y1)))

        taken: list[Bbox] = []
        for kind, v in self.obstacles:
            if kind == "rect":
                box = rect(*v)
            elif kind == "point":
                cx, cy = data.transform((v[0], v[1]))
                r = v[2] / 2 * px
                box = Bbox.from_extents(cx - r, cy - r, cx + r, cy + r)
            else:
                x, y0, y1, width = v
                box = rect(x, x, y0, y1)
                box = Bbox.from_extents(
                    box.x0 - width / 2 * px, box.y0, box.x1 + width / 2 * px, box.y1
                )
            (x0, x1), (y0, y1) = sorted(box.intervalx), sorted(box.intervaly)
            taken.append(Bbox.from_extents(x0, y0, x1, y1))
        taken += [artist.get_window_extent(renderer) for artist in self.fixed]
        area = ax.get_window_extent(renderer)
        # One lane in points, so the first slots just clear a hold bar.
        lane = abs(data.transform((0, 1))[1] - data.transform((0, 0))[1]) / px
        near = _BAR * lane + 1.0
        far = near + 11.0
        up = [(near, "bottom"), (far, "bottom")]
        down = [(-near, "top"), (-far, "top")]
        for _, x, y, texts, side, stay_right, style in sorted(
            self.wanted, key=lambda w: (w[0], w[1])
        ):
            rows = up + down if side == "above" else down + up
            sides = [
                [(dx, dy, ha, va) for dy, va in rows] for dx, ha in ((3, "left"), (-3, "right"))
            ]
            tries = (
                [(text, slots) for slots in sides for text in texts]
                if stay_right
                else [(text, sides[0] + sides[1]) for text in texts]
            )
            if not any(
                self._fit(text, x, y, slots, style, taken, area, renderer) for text, slots in tries
            ):
                self.dropped.append(texts[0])

    def _fit(
        self,
        text: str,
        x: float,
        y: float,
        slots: list[tuple[float, float, str, str]],
        style: dict[str, Any],
        taken: list[Any],
        area: Any,
        renderer: Any,
    ) -> bool:
        """Draw ``text`` in the first slot where it fits; False if none."""
        from matplotlib.transforms import Bbox

        for dx, dy, ha, va in slots:
            label = self.ax.annotate(
                text, (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha, va=va, **style
            )
            box = label.get_window_extent(renderer).padded(1.0)
            # Beside another label, a wider margin across, so two labels side by side never
            # read as one ("#19 f=1#19 f=3"); markers and bars need only the padding.
            gap = _GAP * self.ax.figure.dpi / 72.0
            wide = Bbox.from_extents(box.x0 - gap, box.y0, box.x1 + gap, box.y1)
            inside = (
                box.x0 >= area.x0 and box.x1 <= area.x1 and box.y0 >= area.y0 and box.y1 <= area.y1
            )
            if (
                inside
                and not any(box.overlaps(other) for other in taken)
                and not any(wide.overlaps(other) for other in self.placed)
            ):
                taken.append(box)
                self.placed.append(box)
                return True
            label.remove()
        return False

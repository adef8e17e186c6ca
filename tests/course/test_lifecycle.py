"""The lifecycle diagram of notebook 06: its arrows name real statements and statuses, and
it draws with every statement on an arrow and no label running into another."""

from __future__ import annotations

import itertools

import matplotlib
import numpy as np
from matplotlib.path import Path
from matplotlib.text import Annotation

from pgqueue import statements
from pgqueue.course.lifecycle import TRANSITIONS, lifecycle, schema_statuses

matplotlib.use("Agg")


def test_schema_lists_the_five_statuses() -> None:
    assert schema_statuses() == ["ready", "running", "done", "dead", "cancelled"]


def test_every_arrow_names_a_statement_and_the_statuses_it_moves_between() -> None:
    named = statements.queries()
    drawn = {s for t in TRANSITIONS for s in (t.source, t.target)} - {None}
    assert drawn == set(schema_statuses())
    for source, target, statement in TRANSITIONS:
        assert statement in named, statement
        if source is None:  # a new row takes the column's default
            assert f"DEFAULT '{target}'" in statements.schema()
        else:  # the statement's SQL mentions both ends of its arrow
            assert f"'{source}'" in named[statement], (statement, source)
            assert f"'{target}'" in named[statement], (statement, target)


def _points(path: Path) -> np.ndarray:
    """Points every few pixels along a drawn path (display coordinates)."""
    segments = [np.empty((0, 2))]
    for poly in path.to_polygons(closed_only=False):
        for a, b in itertools.pairwise(poly):
            segments.append(a + np.linspace(0, 1, 20)[:, None] * (b - a))
    return np.vstack(segments)


def test_the_figure_shows_every_statement_and_no_label_touches_another_or_a_line() -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12.5, 7.4))
    try:
        edges = lifecycle(ax)
        assert edges == list(TRANSITIONS)
        fig.canvas.draw()
        texts = [t for t in ax.texts if t.get_text().strip()]
        shown = "\n".join(t.get_text() for t in texts)
        for statement in {e.statement for e in edges}:
            assert statement in shown, statement
        assert ax.get_title() and ax.get_legend() is not None
        renderer = fig.canvas.get_renderer()
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
        for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
            assert not box_a.overlaps(box_b), f"{a!r} runs into {b!r}"
        arrows = [t.arrow_patch for t in ax.texts if isinstance(t, Annotation) and t.arrow_patch]
        lines = [*arrows, *ax.lines]
        drawn = [_points(line.get_transform().transform_path(line.get_path())) for line in lines]
        for text, box in boxes:
            for pts in drawn:
                inside = (pts[:, 0] > box.x0) & (pts[:, 0] < box.x1)
                inside &= (pts[:, 1] > box.y0) & (pts[:, 1] < box.y1)
                assert not inside.any(), f"an arrow runs through {text!r}"
    finally:
        plt.close(fig)


def test_lifecycle_without_axes_makes_one_figure() -> None:
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    lifecycle()
    made = set(plt.get_fignums()) - before
    assert len(made) == 1
    plt.close(made.pop())

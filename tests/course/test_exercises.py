"""The exercise copies: generated from the lessons, in sync with them, never run by nbval."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pgqueue.course import exercises

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"


def test_committed_copies_are_in_sync_with_the_lessons() -> None:
    problems = exercises.drift(NOTEBOOKS)
    assert not problems, (
        "the exercise copies differ from what the lessons make:\n  "
        + "\n  ".join(problems)
        + f"\nfix: `{exercises.COMMAND}` (or `make exercises`), then commit notebooks/exercises/"
    )


def test_every_lesson_has_an_exercise() -> None:
    missing = exercises.missing_exercises(NOTEBOOKS)
    assert not missing, (
        f"every lesson needs an exercise (a code cell tagged '{exercises.SOLUTION_TAG}'): "
        + ", ".join(missing)
    )


def test_each_lesson_names_its_databases_by_its_own_number() -> None:
    """``make test`` runs the notebooks two at a time, so two lessons sharing a database
    would drop it under each other; and a learner finds lesson NN's rows in course_NN."""
    import re

    sources = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))
    modules = sorted((ROOT / "pgqueue" / "course").rglob("*.py"))
    owners: dict[str, set[str]] = {}
    for path in sources + modules:
        for name in re.findall(r"\bcourse_[0-9a-z_]+", path.read_text(encoding="utf-8")):
            owners.setdefault(name, set()).add(path.name)
    assert owners
    for path in sources:
        number = path.name[:2]
        named = {n for n, files in owners.items() if path.name in files}
        assert named and all(n.startswith(f"course_{number}") for n in named), (path.name, named)
    lessons = {path.name[:2] for path in sources}
    for path in modules:  # a numbered database of a module belongs to a lesson that exists
        for name in (n for n, files in owners.items() if path.name in files):
            number = name.split("_")[1]
            assert not number.isdigit() or number in lessons, (path.name, name)


def test_make_test_collects_the_lessons_only() -> None:
    # The copies cannot run (their checks fail until the learner answers), and a notebook a
    # learner saves in notebooks/ is theirs: the root conftest.py keeps nbval to the lessons
    # the course map links to. This is make test's own selection.
    saved = [
        ROOT / "notebooks" / "Untitled.ipynb",
        ROOT / "notebooks" / "02-skip-locked-Copy1.ipynb",
    ]
    for path in saved:
        path.write_text((ROOT / "notebooks" / "02-skip-locked.ipynb").read_text())
    try:
        nbval = ["--nbval", "--nbval-sanitize-with", "notebooks/sanitize.cfg", "notebooks"]
        collected = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
             *nbval],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
    finally:
        for path in saved:
            path.unlink()
    assert collected.returncode == 0, collected.stdout + collected.stderr
    files = {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line}
    lessons = {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb")}
    assert files == lessons, files ^ lessons


# A small lesson in the course's exercise format.
def code(source: str, cell_id: str, *, tags: list[str] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"execution": {"iopub.execute_input": "2026-01-01T00:00:00Z"}}
    if tags:
        metadata["tags"] = tags
    return {
        "cell_type": "code",
        "execution_count": 7,
        "id": cell_id,
        "metadata": metadata,
        "outputs": [{"name": "stdout", "output_type": "stream", "text": ["ran\n"]}],
        "source": source.splitlines(keepends=True),
    }


def markdown(source: str, cell_id: str, *, tags: list[str] | None = None) -> dict[str, Any]:
    return {
        "cell_type": "markdown",
        "id": cell_id,
        "metadata": {"tags": tags} if tags else {},
        "source": source.splitlines(keepends=True),
    }


SOLUTION = (
    "# NBVAL_IGNORE_OUTPUT\n"
    "# Write the reaper's UPDATE: return jobs whose lease ran out.\n"
    "# Keep the row count.\n"
    "reap_sql = \"UPDATE jobs SET status = 'ready' WHERE lease_until < now()\"\n"
    "# a comment inside the solution is not part of the stub\n"
    "n = run(reap_sql)"
)


def lesson() -> dict[str, Any]:
    return {
        "cells": [
            markdown(
                "# 03 · Leases\n\n"
                "[Course map](README.md) · [04 · Fences →](04-fences.ipynb#top)\n"
                "Data: [bench](../data/bench.csv), ![plot](./figures/a.png), "
                "[docs](https://www.postgresql.org/docs/current/sql-update.html), "
                "[below](#exercise), `[not a link](README.md)`\n"
                '<img src="figures/b.png"> [ref]\n\n'
                "[ref]: ../data/machine.json\n\n"
                "```markdown\n[in a fence](README.md)\n```",
                "title",
            ),
            code("import os\n\nrun = len", "setup"),
            markdown(
                "### Exercise: the reaper\n\n**Predict, then run.** Which jobs come back?",
                "ask",
            ),
            code(SOLUTION, "answer", tags=["solution", "keep-me"]),
            markdown("Why: the lease ran out.", "why", tags=["solution"]),
            code("check(reap_sql)", "check"),
        ],
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "widgets": {"application/vnd.jupyter.widget-state+json": {"state": {}}},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


LESSONS = frozenset({"03-leases.ipynb", "04-fences.ipynb"})


def test_the_exercise_copy_keeps_the_stub_and_drops_the_solution() -> None:
    source = lesson()
    before = json.dumps(source, sort_keys=True)
    copy = exercises.exercise_copy(source, "03-leases.ipynb", LESSONS)
    assert json.dumps(source, sort_keys=True) == before, "the source must not change"
    cells = {cell["id"]: cell for cell in copy["cells"]}
    text = {cell_id: "".join(cell["source"]) for cell_id, cell in cells.items()}

    # The first cell says what this is and where the solutions are.
    assert copy["cells"][0]["id"] == exercises.NOTE_ID
    assert "generated from [`../03-leases.ipynb`](../03-leases.ipynb)" in text[exercises.NOTE_ID]
    assert exercises.COMMAND in text[exercises.NOTE_ID]
    # The solution code cell: the learner's comments and the stub line, nothing else.
    assert text["answer"] == (
        "# Write the reaper's UPDATE: return jobs whose lease ran out.\n"
        "# Keep the row count.\n"
        "# Write your code here."
    )
    assert cells["answer"]["metadata"] == {"tags": ["keep-me"]}
    # The solution's explanation is gone; the question and the check stay, in order.
    assert "why" not in cells
    order = [cell["id"] for cell in copy["cells"]]
    assert order == [
        exercises.NOTE_ID,
        "title",
        exercises.CWD_ID,
        "setup",
        "ask",
        "answer",
        "check",
    ]
    # No outputs, no execution counts, no run metadata, no widget state.
    for cell in copy["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None
        assert "execution" not in cell["metadata"]
    assert "widgets" not in copy["metadata"]
    assert copy["metadata"]["kernelspec"]["name"] == "python3"


def test_links_still_work_from_the_exercises_folder() -> None:
    copy = exercises.exercise_copy(lesson(), "03-leases.ipynb", LESSONS)
    title = "".join(next(c for c in copy["cells"] if c["id"] == "title")["source"])
    # A lesson: its exercise copy, beside this one. Anything else: the same file as before.
    assert "[04 · Fences →](04-fences.ipynb#top)" in title
    assert "[Course map](../README.md)" in title
    assert "[bench](../../data/bench.csv)" in title
    assert "![plot](../figures/a.png)" in title
    assert '<img src="../figures/b.png">' in title
    assert "[ref]: ../../data/machine.json" in title
    # Untouched: absolute URLs, anchors, code spans and fenced code.
    assert "(https://www.postgresql.org/docs/current/sql-update.html)" in title
    assert "[below](#exercise)" in title
    assert "`[not a link](README.md)`" in title
    assert "[in a fence](README.md)" in title


def test_the_exercise_copy_is_a_valid_notebook() -> None:
    nbformat = pytest.importorskip("nbformat")
    copy = exercises.exercise_copy(lesson(), "03-leases.ipynb", LESSONS)
    nbformat.validate(nbformat.from_dict(copy))
    # Written as nbformat writes it, so opening and saving it in Jupyter changes nothing.
    written = exercises.dumps(copy)
    assert written == nbformat.writes(nbformat.reads(written, as_version=4)) + "\n"


def test_a_solution_cell_with_no_comments_becomes_the_stub_line() -> None:
    source = lesson()
    source["cells"][3] = code("reap_sql = 'UPDATE ...'", "answer", tags=["solution"])
    copy = exercises.exercise_copy(source, "03-leases.ipynb", LESSONS)
    answer = next(c for c in copy["cells"] if c["id"] == "answer")
    assert answer["source"] == [exercises.STUB_LINE]
    assert "tags" not in answer["metadata"]


def test_generating_twice_changes_nothing_and_check_finds_drift(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "03-leases.ipynb").write_text(json.dumps(lesson()), encoding="utf-8")
    plain = lesson()
    plain["cells"] = [c for c in plain["cells"] if "tags" not in c["metadata"]]
    (tmp_path / "04-fences.ipynb").write_text(json.dumps(plain), encoding="utf-8")
    (tmp_path / "README.md").write_text(COURSE_MAP, encoding="utf-8")
    args = ["--notebooks", str(tmp_path)]
    copies = tmp_path / "exercises"

    assert exercises.main(args) == 0
    first = {p.name: p.read_bytes() for p in copies.iterdir()}
    assert sorted(first) == ["03-leases.ipynb", "04-fences.ipynb"]
    capsys.readouterr()
    assert exercises.main(args) == 0
    assert capsys.readouterr().out == "", "a second run must write nothing"
    assert {p.name: p.read_bytes() for p in copies.iterdir()} == first
    assert exercises.main([*args, "--check"]) == 0

    # A lesson without a solution cell passes unless exercises are required.
    assert exercises.main([*args, "--check", "--require-exercises"]) == 1
    out = capsys.readouterr().out
    assert "no exercise: 04-fences.ipynb" in out and "03-leases" not in out

    # Drifted, missing and extra copies: one line each, and how to fix it.
    (copies / "03-leases.ipynb").write_text("{}", encoding="utf-8")
    (copies / "04-fences.ipynb").unlink()
    (copies / "02-gone.ipynb").write_text("{}", encoding="utf-8")
    assert exercises.main([*args, "--check"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "out of date: exercises/03-leases.ipynb (its source 03-leases.ipynb changed)",
        "missing: exercises/04-fences.ipynb (from 04-fences.ipynb)",
        "extra: exercises/02-gone.ipynb (no source 02-gone.ipynb)",
        f"to fix: run `{exercises.COMMAND}` (or `make exercises`) and commit the copies",
    ]
    # Writing brings the folder back in sync, removing the copy without a source.
    assert exercises.main(args) == 0
    assert {p.name: p.read_bytes() for p in copies.iterdir()} == first


COURSE_MAP = "| 03 | [Leases](03-leases.ipynb) | ... |\n| 04 | [Fences](04-fences.ipynb) | ... |\n"


def test_the_lessons_are_the_notebooks_the_course_map_links_to(tmp_path: Path) -> None:
    # A learner's copy saved beside the lessons is named like one; before, the glob made
    # an exercise copy of it (exercises/03-leases-Copy1.ipynb)
    for name in ("03-leases.ipynb", "04-fences.ipynb", "03-leases-Copy1.ipynb"):
        (tmp_path / name).write_text(json.dumps(lesson()), encoding="utf-8")
    (tmp_path / "README.md").write_text(COURSE_MAP, encoding="utf-8")
    assert [p.name for p in exercises.lessons(tmp_path)] == ["03-leases.ipynb", "04-fences.ipynb"]
    assert exercises.main(["--notebooks", str(tmp_path)]) == 0
    assert sorted(p.name for p in (tmp_path / "exercises").iterdir()) == [
        "03-leases.ipynb",
        "04-fences.ipynb",
    ]
    # and the course's own: the lessons of notebooks/README.md, 01-17 and the optional 18
    assert len(exercises.lessons(ROOT / "notebooks")) == 18


def test_an_exercise_needs_a_solution_code_cell() -> None:
    assert exercises.has_exercise(lesson())
    notes_only = lesson()
    notes_only["cells"] = [c for c in notes_only["cells"] if c["id"] != "answer"]
    assert not exercises.has_exercise(notes_only), "a tagged note alone leaves nothing to write"

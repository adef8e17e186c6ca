"""Make the exercise copies of the lessons: one source notebook, two outputs.

The lessons ``notebooks/NN-name.ipynb`` that the course map (``notebooks/README.md``) links
to are the solution notebooks, and nbval runs them.
``python -m pgqueue.course.exercises`` writes ``notebooks/exercises/NN-name.ipynb`` from
each of them:

- a code cell tagged ``solution`` keeps only its leading comment lines (the learner's
  stub; ``# NBVAL_...`` markers are dropped) and a ``# Write your code here.`` line;
- a markdown (or raw) cell tagged ``solution`` is dropped;
- every output and execution count is cleared, with the run's timing metadata;
- a first cell says the copy is generated and where the solutions are, and a code cell
  before the first code cell moves the kernel to ``notebooks/``, so the lesson's relative
  paths (``../data/...``, ``example_tasks.py``) still work;
- relative links in markdown still work from ``exercises/``: a link to a lesson goes to
  that lesson's exercise copy (the learner stays among the exercises), any other relative
  link goes to the same file as from the source (``../README.md``, ``../../data/x.csv``).

The output is a pure function of the source, written as nbformat writes it, so running
the generator twice changes nothing. ``--check`` writes nothing and lists the copies that
differ from what it would write, are missing or have no source (exit 1), and
``--require-exercises`` also fails for a lesson with no code cell tagged ``solution``.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SOLUTION_TAG = "solution"
STUB_LINE = "# Write your code here."
EXERCISES_DIR = "exercises"
LESSON_GLOB = "[0-9][0-9]-*.ipynb"
COMMAND = "python -m pgqueue.course.exercises"

# Cell metadata that records a run, not the lesson (nbconvert, jupyterlab-execute-time).
RUN_METADATA = ("execution", "ExecuteTime", "scrolled")
# Notebook metadata that belongs to outputs: the state of the widgets drawn by a run.
OUTPUT_METADATA = ("widgets",)

NOTE_ID = "exercise-copy-note"
CWD_ID = "exercise-copy-cwd"
CWD_SOURCE = [
    "# The exercise copy runs from notebooks/, as its source does, so relative paths work.\n",
    "import os\n",
    "\n",
    'if os.path.basename(os.getcwd()) == "exercises":\n',
    '    os.chdir("..")',
]

Notebook = dict[str, Any]
Cell = dict[str, Any]


# A lesson is a notebook the course map links to, as the root conftest.py's
# pytest_ignore_collect decides too: a learner's 02-skip-locked-Copy1.ipynb is not one.
COURSE_MAP = "README.md"
_MAP_LINK = re.compile(r"\]\((\d\d-[\w-]+\.ipynb)\)")


def lessons(notebooks: Path) -> list[Path]:
    """The source notebooks in ``notebooks``, in course order: those its course map
    (``README.md``) links to (``NN-name.ipynb``), not every file named like one."""
    course_map = notebooks / COURSE_MAP
    if not course_map.exists():
        return []
    linked = set(_MAP_LINK.findall(course_map.read_text(encoding="utf-8")))
    return sorted(path for path in notebooks.glob(LESSON_GLOB) if path.name in linked)


def has_exercise(nb: Notebook) -> bool:
    """Whether a notebook has an exercise: at least one code cell tagged ``solution``."""
    return any(_is_solution(cell) and cell["cell_type"] == "code" for cell in nb["cells"])


def exercise_copy(nb: Notebook, name: str, lesson_names: frozenset[str] = frozenset()) -> Notebook:
    """The exercise copy of source notebook ``nb`` (file ``name``); ``nb`` is not changed.

    ``lesson_names`` are the file names that have an exercise copy beside this one: links
    to them stay as they are, other relative links get ``../``.
    """
    out = copy.deepcopy(nb)
    cells: list[Cell] = []
    for cell in out["cells"]:
        if _is_solution(cell) and cell["cell_type"] != "code":
            continue
        _strip_run(cell)
        if _is_solution(cell):
            cell["source"] = _lines(_stub(_text(cell["source"])))
            _untag(cell)
        elif cell["cell_type"] == "markdown":
            cell["source"] = _lines(rewrite_links(_text(cell["source"]), lesson_names))
        cells.append(cell)

    with_ids = out.get("nbformat", 4) > 4 or out.get("nbformat_minor", 0) >= 5
    taken = {cell.get("id") for cell in cells}
    note = _new_cell("markdown", _note(name), NOTE_ID if with_ids else None, taken)
    first_code = next((i for i, c in enumerate(cells) if c["cell_type"] == "code"), None)
    if first_code is not None:
        cwd = _new_cell("code", "".join(CWD_SOURCE), CWD_ID if with_ids else None, taken)
        cells.insert(first_code, cwd)
    out["cells"] = [note, *cells]
    for key in OUTPUT_METADATA:
        out.get("metadata", {}).pop(key, None)
    return out


def dumps(nb: Notebook) -> str:
    """The notebook as nbformat writes it (stable: the same notebook, the same bytes)."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def render(notebooks: Path) -> dict[str, str]:
    """The exercise copies' text, by file name, for every lesson in ``notebooks``."""
    sources = lessons(notebooks)
    names = frozenset(path.name for path in sources)
    return {path.name: dumps(exercise_copy(_read(path), path.name, names)) for path in sources}


def missing_exercises(notebooks: Path) -> list[str]:
    """The lessons in ``notebooks`` with no code cell tagged ``solution``."""
    return [path.name for path in lessons(notebooks) if not has_exercise(_read(path))]


def drift(notebooks: Path) -> list[str]:
    """One line per exercise copy that is out of date, missing, or has no source."""
    wanted = render(notebooks)
    target = notebooks / EXERCISES_DIR
    problems = []
    for name, text in wanted.items():
        path = target / name
        if not path.exists():
            problems.append(f"missing: {EXERCISES_DIR}/{name} (from {name})")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"out of date: {EXERCISES_DIR}/{name} (its source {name} changed)")
    for path in _copies(target):
        if path.name not in wanted:
            problems.append(f"extra: {EXERCISES_DIR}/{path.name} (no source {path.name})")
    return problems


def write(notebooks: Path) -> list[str]:
    """Write the exercise copies that changed and remove those without a source.

    Returns one line per file written or removed (none when everything was in sync).
    """
    wanted = render(notebooks)
    target = notebooks / EXERCISES_DIR
    target.mkdir(exist_ok=True)
    done = []
    for name, text in wanted.items():
        path = target / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            done.append(f"wrote {EXERCISES_DIR}/{name}")
    for path in _copies(target):
        if path.name not in wanted:
            path.unlink()
            done.append(f"removed {EXERCISES_DIR}/{path.name} (no source)")
    return done


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: write the exercise copies, or check them (exit 1 on drift)."""
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description="Write notebooks/exercises/NN-*.ipynb from the lessons notebooks/NN-*.ipynb.",
    )
    parser.add_argument(
        "--notebooks",
        type=Path,
        default=_default_notebooks(),
        help="the folder of the lessons (default: the course's notebooks/)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; list the copies that are out of date, missing or extra (exit 1)",
    )
    parser.add_argument(
        "--require-exercises",
        action="store_true",
        help="also fail for a lesson with no code cell tagged 'solution'",
    )
    args = parser.parse_args(argv)
    notebooks: Path = args.notebooks
    if not lessons(notebooks):
        print(
            f"error: no lessons in {notebooks}/ (notebooks {LESSON_GLOB} that its "
            f"{COURSE_MAP} links to)",
            file=sys.stderr,
        )
        return 2

    problems = []
    if args.require_exercises:
        problems += [
            f"no exercise: {name} has no code cell tagged '{SOLUTION_TAG}' "
            "(every lesson needs an exercise)"
            for name in missing_exercises(notebooks)
        ]
    if args.check:
        stale = drift(notebooks)
        problems += stale
        if stale:
            problems.append(f"to fix: run `{COMMAND}` (or `make exercises`) and commit the copies")
    else:
        for line in write(notebooks):
            print(line)
    for line in problems:
        print(line)
    return 1 if problems else 0


def rewrite_links(markdown: str, lesson_names: frozenset[str] = frozenset()) -> str:
    """``markdown`` with its relative links made to work from ``exercises/``.

    Handles inline links and images, reference definitions and HTML ``href``/``src``;
    leaves code (fenced blocks, inline spans), absolute URLs and ``#anchors`` alone.
    """
    out = []
    fence: str | None = None
    for line in markdown.splitlines(keepends=True):
        opening = _FENCE.match(line)
        if fence is not None:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence):
                fence = None
            out.append(line)
        elif opening:
            fence = opening.group(1)
            out.append(line)
        else:
            out.append(_rewrite_line(line, lesson_names))
    return "".join(out)


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")
_INLINE = re.compile(r"(\]\(\s*<?)([^)\s>]+)")
_REFERENCE = re.compile(r"^( {0,3}\[[^\]]+\]:\s*<?)(\S+?)(?=>|\s|$)")
_HTML = re.compile(r"""(\b(?:href|src)\s*=\s*["'])([^"']+)""", re.IGNORECASE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _rewrite_line(line: str, lesson_names: frozenset[str]) -> str:
    def fix(match: re.Match[str]) -> str:
        return match.group(1) + _relocate(match.group(2), lesson_names)

    line = _REFERENCE.sub(fix, line)
    parts = []
    last = 0
    for span in _CODE_SPAN.finditer(line):
        parts.append(_HTML.sub(fix, _INLINE.sub(fix, line[last : span.start()])))
        parts.append(span.group(0))
        last = span.end()
    parts.append(_HTML.sub(fix, _INLINE.sub(fix, line[last:])))
    return "".join(parts)


def _relocate(target: str, lesson_names: frozenset[str]) -> str:
    """Where ``target``, relative to a lesson, is relative to its exercise copy."""
    if not target or target.startswith(("#", "/")) or _SCHEME.match(target):
        return target
    path = target.removeprefix("./")
    if path.startswith(EXERCISES_DIR + "/"):  # already an exercise copy: a neighbour now
        return path.removeprefix(EXERCISES_DIR + "/")
    if re.split(r"[#?]", path, maxsplit=1)[0] in lesson_names:
        return path
    return "../" + path


def _note(name: str) -> str:
    return (
        f"> **Exercise copy.** This notebook is generated from [`../{name}`](../{name}) by\n"
        f"> `{COMMAND}` (`make exercises`): do not edit it; edit the source and\n"
        "> regenerate. Each exercise's code cell is left for you: predict what will happen,\n"
        f"> write your answer where it says `{STUB_LINE}`, then run the check below it.\n"
        f"> The solutions are in the source notebook, [`../{name}`](../{name})."
    )


def _stub(source: str) -> str:
    """The leading comment lines of a solution cell, without nbval markers, and the stub."""
    kept = []
    for line in source.splitlines():
        if not line.lstrip().startswith("#"):
            break
        if not line.lstrip().lstrip("#").strip().startswith("NBVAL_"):
            kept.append(line)
    return "\n".join([*kept, STUB_LINE])


def _is_solution(cell: Cell) -> bool:
    return SOLUTION_TAG in cell.get("metadata", {}).get("tags", [])


def _untag(cell: Cell) -> None:
    metadata = cell["metadata"]
    metadata["tags"] = [tag for tag in metadata["tags"] if tag != SOLUTION_TAG]
    if not metadata["tags"]:
        del metadata["tags"]


def _strip_run(cell: Cell) -> None:
    for key in RUN_METADATA:
        cell.get("metadata", {}).pop(key, None)
    if cell["cell_type"] == "code":
        cell["outputs"] = []
        cell["execution_count"] = None


def _new_cell(kind: str, source: str, cell_id: str | None, taken: set[Any]) -> Cell:
    cell: Cell = {"cell_type": kind, "metadata": {}, "source": _lines(source)}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    if cell_id is not None:
        if cell_id in taken:
            raise ValueError(f"the source already has a cell with id {cell_id!r}")
        cell["id"] = cell_id
    return cell


def _text(source: str | list[str]) -> str:
    return source if isinstance(source, str) else "".join(source)


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _read(path: Path) -> Notebook:
    return json.loads(path.read_text(encoding="utf-8"))


def _copies(target: Path) -> list[Path]:
    return sorted(target.glob("*.ipynb")) if target.is_dir() else []


def _default_notebooks() -> Path:
    checkout = Path(__file__).resolve().parents[2] / "notebooks"
    return checkout if checkout.is_dir() else Path("notebooks")


if __name__ == "__main__":
    sys.exit(main())

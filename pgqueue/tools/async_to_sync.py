"""Write the sync faces from their async sources, so the two cannot drift (psycopg's way).

``async_job.py`` is the source of ``job.py``: the same claim, written once. The sync file is
the async one with ``async``/``await`` taken away and the names of ``NAMES`` swapped, token
by token, so comments and layout stay; then ``ruff format``. The module's docstring is
kept as it is (write it for both files). Two line markers say what differs: a line ending
in ``# async-only`` is left out of the sync file, and a comment line ``# sync: code``
becomes ``code`` there.

    python pgqueue/tools/async_to_sync.py          # write the sync files
    python pgqueue/tools/async_to_sync.py --check  # fail if one differs (make lint, CI)
"""

from __future__ import annotations

import argparse
import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent

# Names the sync face calls otherwise (whole tokens: names in code, words in strings).
NAMES = {
    "AsyncQueue": "Queue",
    "AsyncJob": "Job",
    "AsyncConnection": "Connection",
    "AsyncCursor": "Cursor",
    "AsyncIterator": "Iterator",
    "asynccontextmanager": "contextmanager",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "async_connect": "connect",
    "async_own_cursor": "own_cursor",
    "async_fenced_write": "fenced_write",
    "async_write_answer": "write_answer",
    "your_async_conn": "your_conn",
    "async_job": "job",
    "_async_step_run": "_step_run",
}

# source -> (generated, names of its own), inside the package
PAIRS = {
    "async_job.py": ("job.py", {"asyncio": "threading"}),  # the borrow lock
    "async_queue.py": ("queue.py", {}),
}

ASYNC_ONLY = re.compile(r"\s*# async-only\s*$")
SYNC_LINE = re.compile(r"^(\s*)# sync: (.*?)\s*$")
HEADER = (
    "# Generated from {source} by `python pgqueue/tools/async_to_sync.py`: edit that file,\n"
    "# then run the command again (make lint fails while the two differ).\n"
)


def convert(source: str, name: str, own: dict[str, str] | None = None) -> str:
    """The sync module for async ``source`` (not yet formatted); ``own``: names swapped in
    this file only, beside ``NAMES``."""
    names = NAMES | (own or {})
    word = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    lines = []
    for line in source.splitlines(keepends=True):
        if ASYNC_ONLY.search(line):
            continue
        marked = SYNC_LINE.match(line)
        lines.append(f"{marked.group(1)}{marked.group(2)}\n" if marked else line)
    text = "".join(lines)
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement) as offsets
    starts = _line_starts(text)
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    skip = (tokenize.ENCODING, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)
    first = next((t for t in tokens if t.type not in skip), None)
    for i, tok in enumerate(tokens):
        if tok is first and tok.type == tokenize.STRING:
            continue  # the module's docstring: written for both files
        start = starts[tok.start[0] - 1] + tok.start[1]
        end = starts[tok.end[0] - 1] + tok.end[1]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if tok.type == tokenize.NAME and tok.string == "await":
            edits.append((start, end + 1, ""))  # the keyword and the space after it
        elif (
            tok.type == tokenize.NAME
            and tok.string == "async"
            and nxt is not None
            and nxt.string in ("def", "with", "for")
        ):
            edits.append((start, end + 1, ""))
        elif tok.type == tokenize.NAME and tok.string in names:
            edits.append((start, end, names[tok.string]))
        elif tok.type in (tokenize.STRING, tokenize.COMMENT):
            words = word.sub(lambda m: names[m.group(1)], tok.string)
            words = words.replace("await ", "").replace("async with", "with")
            if words != tok.string:
                edits.append((start, end, words))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return HEADER.format(source=name) + text


def _line_starts(text: str) -> list[int]:
    starts, at = [], 0
    for line in text.splitlines(keepends=True):
        starts.append(at)
        at += len(line)
    return [*starts, at]


def formatted(text: str, path: Path) -> str:
    """``text`` with its imports sorted again (names were swapped) and as ``ruff format``
    leaves it, by the project's own settings."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        raise SystemExit("async_to_sync: ruff is not installed (pip install -e '.[dev]')")
    for step in (["check", "--select", "I", "--fix", "--exit-zero", "--quiet"], ["format"]):
        done = subprocess.run(
            [ruff, *step, "--stdin-filename", str(path), "-"],
            input=text,
            capture_output=True,
            text=True,
            check=False,
            cwd=PACKAGE.parent,
        )
        if done.returncode != 0:
            raise SystemExit(f"async_to_sync: ruff {step[0]} failed on {path.name}: {done.stderr}")
        text = done.stdout
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python pgqueue/tools/async_to_sync.py")
    parser.add_argument("--check", action="store_true", help="fail if a sync file differs")
    args = parser.parse_args(argv)
    stale = []
    for source, (target, own) in PAIRS.items():
        path = PACKAGE / target
        code = (PACKAGE / source).read_text(encoding="utf-8")
        text = formatted(convert(code, source, own), path)
        if args.check:
            if path.read_text(encoding="utf-8") != text:
                stale.append(f"{target} differs from what {source} makes")
        else:
            path.write_text(text, encoding="utf-8")
    for line in stale:
        print(f"async_to_sync: {line}: run python pgqueue/tools/async_to_sync.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

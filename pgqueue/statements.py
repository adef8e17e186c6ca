"""Load the named SQL blocks of ``sql/*.sql`` once, so every query lives in a .sql file."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def parse(text: str) -> dict[str, str]:
    """Split a file of ``-- name: x`` blocks into {name: statement} (comments kept)."""
    parts = _NAME.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


@cache
def schema() -> str:
    """The schema script, run as one block by ``Queue.install()``."""
    return resources.files("pgqueue").joinpath("sql/schema.sql").read_text(encoding="utf-8")


@cache
def queries() -> dict[str, str]:
    """Every statement of ``sql/queries.sql`` by name."""
    text = resources.files("pgqueue").joinpath("sql/queries.sql").read_text(encoding="utf-8")
    return parse(text)


def query(name: str) -> str:
    """One named statement of ``sql/queries.sql``."""
    return queries()[name]

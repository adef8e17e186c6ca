"""``pgqueue enqueue`` payloads JSON can parse in principle but Python cannot read: nested
deeper than the interpreter's recursion limit, or an integer longer than Python's
int-string conversion limit. Each gets a one-line error (exit 2), and nothing is written."""

from __future__ import annotations

import pytest
from test_cli import job_rows, pgqueue, user_error

DEEP_ARRAYS = "[" * 3000 + "]" * 3000
DEEP_OBJECTS = '{"a": ' * 3000 + "1" + "}" * 3000
LONG_INTEGER = '{"n": ' + "7" * 5000 + "}"


@pytest.mark.parametrize(
    ("payload", "said"),
    [
        (DEEP_ARRAYS, "nested too deeply"),
        ('{"a": ' + DEEP_ARRAYS + "}", "nested too deeply"),
        (DEEP_OBJECTS, "nested too deeply"),
        (LONG_INTEGER, "5000 digits"),
    ],
)
@pytest.mark.parametrize("how", ["argument", "stdin"])
def test_a_payload_python_cannot_read_is_one_line_and_writes_nothing(
    dsn: str, payload: str, said: str, how: str
) -> None:
    if how == "argument":
        result = pgqueue("enqueue", "q", payload, dsn=dsn)
        where = "payload"
    else:
        result = pgqueue("enqueue", "q", dsn=dsn, stdin=b'{"ok": 1}\n' + payload.encode() + b"\n")
        where = "stdin line 2"
    line = user_error(result, 2)
    assert line.startswith(f"pgqueue enqueue: {where} ")
    assert said in line and "nothing was enqueued" in line
    assert job_rows(dsn) == []


def test_a_long_number_as_a_string_is_fine(dsn: str) -> None:
    """What the error advises: a long number sent as a JSON string is stored as it is."""
    result = pgqueue("enqueue", "q", '{"n": "' + "7" * 5000 + '"}', dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert job_rows(dsn) == [("q", {"n": "7" * 5000}, "ready")]

"""The exercises' checks: each says in one line what is wrong, or that the answer holds.

One module per lesson (``nb01``, ``nb02``, ...). A check raises ``ExerciseFailed`` (an
``AssertionError``, so a notebook run stops there) with a one-line hint, or prints one
line starting with a check mark.
"""

from __future__ import annotations


class ExerciseFailed(AssertionError):
    """The reader's answer does not hold yet; the message says what to look at."""


def expect(condition: object, hint: str) -> None:
    """Fail with ``hint`` (one line) unless ``condition`` holds."""
    if not condition:
        raise ExerciseFailed(hint)


def passed(what: str) -> None:
    """Say that an answer holds."""
    print(f"\N{CHECK MARK} {what}")

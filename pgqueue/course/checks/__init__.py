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


def compare_prediction(prediction: object, broken: dict[str, object], why: dict[str, str]) -> None:
    """A "break it" exercise: the reader's ``prediction`` (a dict with the keys of
    ``broken``) against what the broken statement did, run live; each wrong guess fails
    with what the run did and ``why``. Text answers compare without case or spaces."""
    expect(
        isinstance(prediction, dict) and set(prediction) == set(broken),
        f"the prediction should be a dict with the keys {', '.join(broken)}",
    )
    assert isinstance(prediction, dict)
    for key, happened in broken.items():
        guess = prediction[key]
        if isinstance(guess, str) and isinstance(happened, str):
            guess = guess.strip().lower()
        expect(
            guess == happened,
            f"{key}: you predicted {prediction[key]!r}, the run says {happened!r}: {why[key]}",
        )


def take_out(statement: object, pattern: str, what: str, name: str) -> str:
    """``statement`` with ``pattern`` (a regular expression, matched once, case ignored)
    taken out: the reader's own statement, broken on purpose."""
    import re

    expect(isinstance(statement, str), f"{name} should be the statement, as text")
    assert isinstance(statement, str)
    out, n = re.subn(pattern, "", statement, flags=re.I)
    expect(n == 1, f"your {name} should hold {what} once, to take it out; it holds it {n} times")
    return out

"""Hints in tiers, for the exercises of notebooks 14 and 15.

The first time an answer makes a given mistake, the check says only what the database
showed (the symptom: which rows, which counts); from the second time the same mistake is
made, it adds the fragment that fixes it. Distinct mistakes have distinct kinds, so a
learner who fixes one and makes another starts again at the symptom. The count lives as
long as the kernel: restarting it starts every hint from the symptom again.
"""

from __future__ import annotations

from collections import Counter

from . import ExerciseFailed


class Hints:
    """The tiered hints of one exercise: ``fail(kind, symptom, fragment)``."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def fail(self, kind: str, symptom: str, fragment: str) -> None:
        """Raise ``ExerciseFailed``: the symptom, and the fragment from the second time."""
        self.seen[kind] += 1
        if self.seen[kind] >= 2:
            raise ExerciseFailed(f"{symptom}. Hint: {fragment}")
        raise ExerciseFailed(
            f"{symptom} (fix it and run the check again; the same slip twice shows a hint)"
        )

    def expect(self, condition: object, kind: str, symptom: str, fragment: str) -> None:
        """``fail`` unless ``condition`` holds."""
        if not condition:
            self.fail(kind, symptom, fragment)

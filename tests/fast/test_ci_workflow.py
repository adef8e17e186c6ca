"""CI where users push: .github/workflows/test.yml runs the README's commands on every push
and pull request, and passes the workflow linter that ``make lint`` runs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "test.yml"


def test_the_workflow_runs_the_readme_s_commands_on_every_push_and_pull_request() -> None:
    text = WORKFLOW.read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make test " in readme  # the README's one test command
    runs = re.findall(r"^\s*- run: (.+)$", text, flags=re.MULTILINE)
    assert runs == ["make setup", "make lint", "make test"]
    on = text.split("\non:\n", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^  (\w+):", on, flags=re.MULTILINE) == ["push", "pull_request"]
    assert 'python-version: "3.12"' in text  # Django 6's tests run, not skipped


def test_make_lint_checks_the_workflows_with_actionlint() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "actionlint .github/workflows/" in lint


def test_the_workflow_passes_actionlint() -> None:
    found = shutil.which("actionlint", path=str(Path(sys.executable).parent)) or shutil.which(
        "actionlint"
    )
    if found is None:
        pytest.skip("actionlint is not installed here (make setup installs it: the dev extra)")
    done = subprocess.run([found, str(WORKFLOW)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr

"""The Binder launch: ``binder/`` follows repo2docker's rules, and a simulated build works.

mybinder.org builds the image with repo2docker, which (for this repository) does:

1. copy the repository into ``$HOME`` (``REPO_DIR``), owned by the notebook user ``jovyan``;
2. ``pip install -r binder/requirements.txt`` from the repository root, as that user;
3. run ``binder/postBuild`` once, as that user, from the repository root;
4. at each launch, run ``binder/start <the Jupyter server command>`` as that user.

``test_simulated_binder_build_runs_the_notebooks`` does the same without Docker: as a
non-root user (``jovyan``, created if we are root), in a fresh virtual environment
installed only from ``binder/``'s files, then ``binder/start`` wrapping nbval on the
notebooks. It catches a ``binder/`` that drifts from ``pyproject.toml`` and an embedded
server that does not start without root. pip's cache is kept between runs (see
``PIP_CACHE``), so only the first run downloads JupyterLab and friends.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
BINDER = ROOT / "binder"
BINDER_USER = "jovyan"  # the notebook user on mybinder.org
# Notebooks run in the simulated launch: the first one, and the fencing one (widgets).
NOTEBOOKS = ["notebooks/01-the-table.ipynb", "notebooks/04-fencing-tokens.ipynb"]
FIRST_NOTEBOOK = NOTEBOOKS[0]
# What checks the notebooks; installed after binder/'s own files and without their
# dependencies, so that they cannot make up for anything binder/ forgot (pip check).
CHECKER = ["pytest", "pluggy", "iniconfig", "pytest-timeout", "nbval", "coverage"]
# pip's cache, kept between runs (one per user): repeated runs install from it, not PyPI.
PIP_CACHE = "pgqueue-binder-pip-cache-{uid}"  # in the system's temporary directory
# Passed through to the simulated user's environment so pip reaches its index as ours does.
PASS_THROUGH = re.compile(r"PIP_\w+|(?i:\w+_proxy)|SSL_CERT_\w+|REQUESTS_CA_BUNDLE")
MYBINDER_LINK = re.compile(r"https://mybinder\.org/v2/[^\s)\"'>\]]+")


# -- binder/ follows repo2docker's rules ---------------------------------------------------
def test_binder_files_follow_repo2docker_rules() -> None:
    # binder/ exists, so repo2docker reads only it; a second folder is an error there.
    assert not (ROOT / ".binder").exists(), "repo2docker refuses both binder/ and .binder/"
    # Files that would take precedence over requirements.txt (another buildpack).
    for name in ("Dockerfile", "environment.yml", "Pipfile", "Project.toml", "default.nix"):
        assert not (BINDER / name).exists(), f"binder/{name} would replace requirements.txt"

    requirements = _requirement_lines(BINDER / "requirements.txt")
    assert "-e .[notebooks,dashboard,metrics]" in requirements, (
        "binder must install this package with [notebooks], the dashboard's [dashboard] and"
        " the [metrics] notebook 11 scrapes"
    )
    assert any(line.startswith("jupyter-server-proxy") for line in requirements), (
        "binder needs jupyter-server-proxy for the dashboard's launcher tile"
    )
    assert re.fullmatch(r"python-3\.\d+", (BINDER / "runtime.txt").read_text().strip())

    for name in ("postBuild", "start"):
        script = BINDER / name
        text = script.read_text()
        assert text.startswith("#!/bin/bash\n"), f"binder/{name} needs a bash shebang"
        assert "set -euo pipefail" in text, f"binder/{name} must stop at the first error"
        assert os.access(script, os.X_OK), f"binder/{name} must be executable"
        assert "sudo" not in text, f"binder/{name} runs without root"
    last = [ln for ln in (BINDER / "start").read_text().splitlines() if ln.strip()][-1]
    assert last.strip() == 'exec "$@"', 'binder/start must end with exec "$@"'


def test_readme_binder_link_opens_the_first_notebook_in_jupyterlab() -> None:
    links = MYBINDER_LINK.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    if not links:
        pytest.skip("README.md has no mybinder.org link yet (the badge is added with issue 6)")
    for link in links:
        url = urlsplit(link)
        parts = url.path.split("/")
        # /v2/gh/OWNER/REPO/REF
        assert parts[1:3] == ["v2", "gh"] and len(parts) == 6 and all(parts[1:]), link
        query = parse_qs(url.query)
        assert list(query) == ["urlpath"], f"open JupyterLab with ?urlpath=lab/tree/...: {link}"
        urlpath = unquote(query["urlpath"][0])
        assert urlpath.startswith("lab/tree/"), f"urlpath must open JupyterLab: {link}"
        notebook = urlpath.removeprefix("lab/tree/")
        assert notebook == FIRST_NOTEBOOK, f"the link should open {FIRST_NOTEBOOK}: {link}"
        assert (ROOT / notebook).is_file(), f"{notebook} does not exist"


def _requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


# -- a simulated repo2docker build and launch ----------------------------------------------
@dataclass
class NotebookUser:
    """The notebook user of the simulation, its home (the repository copy) and its env."""

    uid: int
    gid: int
    name: str
    work: Path  # everything of the simulation lives here, removed at the end
    as_root: bool

    @property
    def home(self) -> Path:
        return self.work / "home"  # mybinder.org: REPO_DIR is HOME

    @property
    def venv(self) -> Path:
        return self.work / "env"  # outside the repository, as repo2docker's env is

    @property
    def pip_cache(self) -> Path:
        return Path(tempfile.gettempdir()) / PIP_CACHE.format(uid=self.uid)

    def env(self) -> dict[str, str]:
        """A launch environment: nothing of ours but how pip reaches its index."""
        env = {key: value for key, value in os.environ.items() if PASS_THROUGH.fullmatch(key)}
        env.update(
            HOME=str(self.home),
            USER=self.name,
            LOGNAME=self.name,
            LANG="C.UTF-8",
            PATH=f"{self.venv}/bin:/usr/local/bin:/usr/bin:/bin",
            PIP_CACHE_DIR=str(self.pip_cache),
            PIP_DISABLE_PIP_VERSION_CHECK="1",
        )
        return env

    def identity(self) -> dict[str, Any]:
        """``subprocess`` arguments that run a command as this user (when we are root)."""
        if not self.as_root:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def run(self, step: str, *cmd: str | Path, timeout: float) -> str:
        """Run ``cmd`` as the notebook user in its home; its output, or fail the test with it."""
        started = time.monotonic()
        try:
            result = subprocess.run(
                [str(part) for part in cmd],
                cwd=self.home,
                env=self.env(),
                **self.identity(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{step}: no result after {timeout:.0f} s\n{_tail(exc.stdout)}")
        took = time.monotonic() - started
        print(f"{step}: {took:.1f} s")
        if result.returncode != 0:
            pytest.fail(
                f"{step} failed (exit {result.returncode}) after {took:.0f} s\n"
                f"--- stdout ---\n{_tail(result.stdout)}\n--- stderr ---\n{_tail(result.stderr)}"
            )
        return result.stdout + result.stderr


def _tail(text: str | bytes | None, lines: int = 60) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


@pytest.fixture
def notebook_user() -> Iterator[NotebookUser]:
    """The notebook user (``jovyan`` when we are root, else ourselves) and a work dir it owns."""
    as_root = os.geteuid() == 0
    entry = _ensure_user(BINDER_USER) if as_root else pwd.getpwuid(os.geteuid())
    work = Path(tempfile.mkdtemp(prefix="pgqueue-binder-"))
    user = NotebookUser(entry.pw_uid, entry.pw_gid, entry.pw_name, work, as_root)
    user.pip_cache.mkdir(mode=0o700, exist_ok=True)
    if as_root:
        os.chown(work, user.uid, user.gid)
        os.chown(user.pip_cache, user.uid, user.gid)
    try:
        yield user
    finally:
        server = user.venv / "bin" / "pgqueue"
        if server.exists():  # stop the embedded server the launch started, as its user
            subprocess.run(
                [str(server), "server", "stop"],
                cwd=user.home,
                env=user.env(),
                **user.identity(),
                capture_output=True,
                timeout=90,
            )
        shutil.rmtree(work, ignore_errors=True)


def _ensure_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        subprocess.run([useradd, "--create-home", "--shell", "/bin/bash", name], check=True)
        return pwd.getpwnam(name)


def _copy_repository(user: NotebookUser) -> None:
    """What Binder sees: the files git knows (plus new, not ignored ones), owned by the user."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (raw.decode() for raw in listed)):
        source = ROOT / name
        if not source.is_file():  # deleted in the work tree
            continue
        target = user.home / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    if user.as_root:
        for path in [user.home, *user.home.rglob("*")]:
            os.chown(path, user.uid, user.gid, follow_symlinks=False)


def _venv_python(user: NotebookUser) -> str:
    """A Python that the notebook user can run and make virtual environments with."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [Path(sys.base_prefix) / "bin" / version, shutil.which("python3") or ""]
    candidates += [Path("/usr/bin/python3")]
    for candidate in filter(None, map(str, candidates)):
        try:
            probe = subprocess.run(
                [candidate, "-c", "import venv, ensurepip"],
                **user.identity(),
                cwd="/",
                capture_output=True,
            )
        except OSError:  # e.g. a Python under root's private home
            continue
        if probe.returncode == 0:
            return candidate
    pytest.fail(f"no Python with venv and ensurepip that {user.name} can run: {candidates}")


@pytest.mark.binder
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_simulated_binder_build_runs_the_notebooks(notebook_user: NotebookUser) -> None:
    missing = [name for name in NOTEBOOKS if not (ROOT / name).is_file()]
    assert not missing, f"the Binder check runs {NOTEBOOKS}; missing: {missing}"
    user = notebook_user
    _copy_repository(user)
    pip = user.venv / "bin" / "pip"
    pgqueue = user.venv / "bin" / "pgqueue"

    # Build: what repo2docker does, in its order, with only binder/'s files.
    user.run("venv", _venv_python(user), "-m", "venv", user.venv, timeout=120)
    user.run("pip install -r binder/requirements.txt", pip, "install", "-r",
             "binder/requirements.txt", timeout=420)  # fmt: skip
    user.run("binder/postBuild", "./binder/postBuild", timeout=120)
    data = user.home / ".local" / "share" / "pgqueue" / "data"
    assert (data / "PG_VERSION").is_file(), "postBuild should have run initdb in the user's home"
    assert not (data / "postmaster.pid").exists(), "postBuild must leave the server stopped"

    # The checker, without dependencies: anything missing from binder/ shows in pip check.
    user.run("pip install checker", pip, "install", "--no-deps", *CHECKER, timeout=240)
    user.run("pip check", pip, "check", timeout=60)
    # The widget manager for JupyterLab: without it, interact controls show up as text.
    jupyter = user.venv / "bin" / "jupyter"
    extensions = user.run("labextension list", jupyter, "labextension", "list", timeout=120)
    assert re.search(r"@jupyter-widgets/jupyterlab-manager .*enabled", extensions), extensions

    # The dashboard's launcher tile: jupyter-server-proxy finds pgqueue's entry point.
    python = user.venv / "bin" / "python"
    found = user.run(
        "jupyter-server-proxy entry points",
        python,
        "-c",
        "from jupyter_server_proxy.config import get_entrypoint_server_processes as g; "
        "print([p.name for p in g()])",
        timeout=60,
    )
    assert "pgqueue-dashboard" in found, found

    # Launch: binder/start wraps the command, as repo2docker's entrypoint does. No
    # PGQUEUE_HOME: the notebooks use the per-user server that postBuild prepared.
    user.run(
        "binder/start pytest --nbval",
        "./binder/start", python, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider",
        "--nbval", "--nbval-sanitize-with", "notebooks/sanitize.cfg", "-q", *NOTEBOOKS,
        timeout=300,
    )  # fmt: skip
    status = user.run("pgqueue server status", pgqueue, "server", "status", timeout=60)
    assert status.startswith("running:"), status
    assert (data / "postmaster.pid").stat().st_uid == user.uid, "server must run as the user"

"""The course's notebooks open in JupyterLab without being marked unsaved.

JupyterLab writes the running kernel's ``language_info`` into a notebook's metadata as soon
as the kernel answers, and a notebook whose stored ``language_info`` differs is marked
modified before the learner has touched it. The lessons are stored with the Python they were
executed with (3.11.7 here); a learner's Python is rarely that exact version, so every lesson
opened with the unsaved dot, and closing it asked whether to save changes nobody made.

``CourseContents`` is JupyterLab's default contents manager, except that a notebook it hands
out says the Python version of the server, which is the kernel's (the course's kernel is the
environment's own ``python3``). Nothing changes on disk until the learner saves, as with any
notebook. It is a Jupyter server extension, so that it is turned on the usual way, beside
the others, without replacing a configuration file: ``binder/prepare-lab`` (run by
``make course`` and by Binder's ``postBuild``) copies ``binder/jupyter-server-config.json``
into the environment's ``etc/jupyter/jupyter_server_config.d``, and the extension, linked
before the server makes its contents manager, puts ``CourseContents`` in place of the
default (a contents manager configured by the learner is left alone).
``tests/integrations/test_browser.py`` opens a lesson stored with another version and checks
that it is not marked unsaved.
"""

from __future__ import annotations

import sys
from typing import Any

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

# What ipykernel reports as the language version (``IPythonKernel.language_info``).
KERNEL_PYTHON = sys.version.split()[0]


def with_kernel_python(notebook: Any) -> None:
    """Make a Python notebook's stored ``language_info`` say this interpreter's version."""
    info = notebook.get("metadata", {}).get("language_info")
    if isinstance(info, dict) and info.get("name") == "python" and "version" in info:
        info["version"] = KERNEL_PYTHON


class CourseContents(AsyncLargeFileManager):
    """JupyterLab's contents manager, handing out notebooks that match the kernel."""

    async def get(self, path: str, content: bool = True, **kwargs: Any) -> dict[str, Any]:
        model = await super().get(path, content=content, **kwargs)
        if model.get("type") == "notebook" and model.get("content"):
            with_kernel_python(model["content"])
        return model


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "pgqueue.course.lab_contents"}]


def _link_jupyter_server_extension(serverapp: Any) -> None:
    """Runs before the server makes its contents manager: use ours if none was chosen."""
    if serverapp.contents_manager_class is AsyncLargeFileManager:
        serverapp.contents_manager_class = CourseContents


def _load_jupyter_server_extension(serverapp: Any) -> None:
    chosen = type(serverapp.contents_manager).__name__
    serverapp.log.info("pgqueue course: notebooks handed out by %s", chosen)

"""What a test needs from outside the project: a tool or a module that .ci/run installs.
Locally a missing one skips (saying how to get it); in CI (CI set) it fails, so a
broken install can never pass as skipped tests."""

from __future__ import annotations

import os
import shutil

import pytest


def _missing(what: str, how: str):
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing: {how}")
    pytest.skip(f"{what} not installed ({how})")


def tool(name: str, how: str) -> str:
    """The path of command `name`."""
    path = shutil.which(name)
    if path is None:
        _missing(name, how)
    return path


def module(name: str):
    """The imported module `name`."""
    try:
        return __import__(name)
    except ImportError:
        _missing(name, "a dev dependency: pip install -e .[dev]")

"""Fixtures of the end-to-end tests (a trainer, a sentinel and services in processes of their own)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.e2e import Procs


@pytest.fixture(scope="module")
def data_dir(dataset) -> Path:
    """The session's prepared Shakespeare corpus (tests/helpers/trainer.py)."""
    return dataset


@pytest.fixture
def procs():
    """Processes a test starts; every one still running is killed at teardown."""
    ps = Procs()
    yield ps
    ps.kill_all()

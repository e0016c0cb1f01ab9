"""Shared test fixtures: where the reference files live."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _fixtures_dir() -> Path | None:
    for cand in (
        os.environ.get("MINECART_FIXTURES"),
        REPO.parent / "shared" / "fixtures",
        REPO / ".gpu" / "fixtures",
    ):
        if cand and Path(cand).is_dir():
            return Path(cand)
    return None


FIXTURES = _fixtures_dir()


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if FIXTURES is None:
        pytest.skip("shared fixtures not found (set MINECART_FIXTURES)")
    return FIXTURES

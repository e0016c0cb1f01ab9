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


@pytest.fixture(scope="session", autouse=True)
def _private_tokenizer_cache(tmp_path_factory):
    """Tests share one tokenizer merge cache of their own instead of writing to the user's cache."""
    if "MINECART_TOKENIZER_CACHE" in os.environ:
        yield
        return
    os.environ["MINECART_TOKENIZER_CACHE"] = str(tmp_path_factory.mktemp("tokenizer-cache"))
    try:
        yield
    finally:
        os.environ.pop("MINECART_TOKENIZER_CACHE", None)

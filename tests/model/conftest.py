"""The real all-mpnet-base-v2 for the model tests marked real_weights (tests/support/mpnet.py assembles it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import mpnet

REQUIRE_ENV = "FUSEDSERVE_REQUIRE_MPNET"


@pytest.fixture(scope="session")
def mpnet_dir() -> Path:
    """The assembled all-mpnet-base-v2 directory. Parts not downloaded (`make mpnet-parts`) nor installed: a skip with
    the reason, or a failure where CI has fetched them and says so (FUSEDSERVE_REQUIRE_MPNET=1). A part that is there
    but not what was recorded always fails."""
    try:
        return mpnet.model_dir()
    except mpnet.MissingParts as exc:
        missing = str(exc)
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{missing} ({REQUIRE_ENV}=1: they are required here)", pytrace=False)
    pytest.skip(missing)

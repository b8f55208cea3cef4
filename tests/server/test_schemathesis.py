"""Schemathesis against the app's own OpenAPI, on the real server: >= 1000 generated requests (coverage,
fuzzing and stateful phases), no 5xx, every response conforming to the schema."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import ADMIN_TOKEN


@pytest.mark.slow  # over a thousand generated requests
def test_generated_requests_get_no_server_errors(server):
    st = shutil.which("st") or str(Path(sys.executable).parent / "st")
    assert Path(st).exists(), "schemathesis's `st` not found: it comes with the dev extra (pip install -e '.[dev]')"
    result = subprocess.run(
        [st, "run", server.url + "/openapi.json", "--url", server.url, "--max-examples", "60", "--seed", "1",
         "--checks", "not_a_server_error,response_schema_conformance",
         "--header", f"Authorization: Bearer {ADMIN_TOKEN}", "--no-color"],
        capture_output=True, text=True, timeout=600)
    summary = result.stdout[-3000:]
    assert result.returncode == 0, summary
    generated = re.search(r"(\d+) generated, (\d+) passed", result.stdout)
    assert generated and int(generated.group(1)) >= 1000 and generated.group(1) == generated.group(2), summary
    assert "Unresolvable references" not in result.stdout, summary

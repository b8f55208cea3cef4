"""The `fusedserve` command as a user runs it: the installed console scripts (`fusedserve`, the `fusedserve-embed`
alias) and `python -m fusedserve`, each in its own process; the hand-over of arguments to each command in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusedserve import cli
from tests.tolerances import assert_unit_length

BIN = Path(sys.executable).parent  # the environment's scripts: fusedserve and fusedserve-embed
# the tiny preset (random weights from a fixed seed) keeps an embedding run to the cost of starting Python and torch
TINY = ["--model", "tiny", "--device", "cpu"]


def run(*command: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """A command as a user runs it: without the test suite's Triton interpreter switch."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def test_help_lists_the_commands():
    result = run(str(BIN / "fusedserve"), "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: fusedserve ")
    assert all(name in result.stdout for name in cli.COMMANDS) and "--version" in result.stdout
    assert run(sys.executable, "-m", "fusedserve", "--help").stdout == result.stdout  # the module is the same command


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: COMMAND"),
    (["serv"], "invalid choice: 'serv'"),
])
def test_a_missing_or_unknown_command_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "embed"])
def test_a_command_gets_every_word_after_its_name_unchanged(command, monkeypatch):
    module = {"serve": "fusedserve.server.__main__", "embed": "fusedserve.model.__main__"}[command]
    received = []
    monkeypatch.setattr(f"{module}.main", lambda argv: received.append(argv) or 7)
    words = ["--port", "9", "--help", "--", "-x", "serve"]
    assert cli.main([command, *words]) == 7  # the command's exit status is the process's
    assert received == [words]


def test_serve_help_is_the_servers():
    result = run(str(BIN / "fusedserve"), "serve", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: fusedserve serve ")
    assert all(option in result.stdout for option in ("--host", "--port", "--config", "--log-level"))


@pytest.mark.slow
def test_embed_prints_a_json_line_per_text_with_the_default_model():
    result = run(str(BIN / "fusedserve"), "embed", "A man is eating food.", "hello")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["text"] for r in rows] == ["A man is eating food.", "hello"]
    assert all(r["dim"] == 384 for r in rows)
    assert_unit_length([r["embedding"] for r in rows])
    assert "model all-MiniLM-L6-v2" in result.stderr and "kernel backends" in result.stderr  # the report, on stderr


@pytest.mark.slow
def test_the_module_and_the_alias_embed_as_the_command_does():
    texts = ["fused kernels", "x"]
    by_module = run(sys.executable, "-m", "fusedserve", "embed", *TINY, *texts)
    by_alias = run(str(BIN / "fusedserve-embed"), *TINY, *texts)
    assert by_module.returncode == 0, by_module.stderr
    assert by_alias.returncode == 0, by_alias.stderr
    rows = [json.loads(line) for line in by_module.stdout.splitlines()]
    assert [r["text"] for r in rows] == texts and all(r["dim"] == 64 for r in rows)
    assert_unit_length([r["embedding"] for r in rows])
    assert by_alias.stdout == by_module.stdout


@pytest.mark.parametrize("settings, message", [
    ({"FUSEDSERVE_GRPC_PORT": "18231"}, "grpc_port 18231 is the HTTP port"),
    ({"FUSEDSERVE_FRONTENDS": "2", "FUSEDSERVE_WORKERS": "2"}, "set FRONTENDS"),
    ({"FUSEDSERVE_FRONTENDS": "65"}, "frontends must be between 0 and 64"),
])
def test_serve_refuses_settings_that_cannot_work_together(settings, message):
    """Exit code 2 and the reason, before any model loads: ports both listening with SO_REUSEPORT would split the
    connections silently; FRONTENDS and WORKERS are two process models."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSEDSERVE_") and k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "fusedserve", "serve", "--port", "18231"], capture_output=True,
                            text=True, timeout=120, env={**env, "FUSEDSERVE_DEVICE": "cpu", **settings})
    assert result.returncode == 2, result.stderr
    assert "invalid configuration" in result.stderr and message in result.stderr, result.stderr


@pytest.mark.slow
def test_embed_quiet_prints_only_the_json_lines():
    """`--quiet` is for scripts: stdout holds one JSON line per text and stderr nothing (no report, hint or warning)."""
    texts = ["fused kernels", "hello"]
    result = run(str(BIN / "fusedserve"), "embed", "--quiet", *TINY, *texts)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["text"] for r in rows] == texts and all(r["dim"] == 64 for r in rows)
    assert_unit_length([r["embedding"] for r in rows])


@pytest.mark.slow
def test_embed_without_quiet_points_repeated_use_at_the_server():
    result = run(str(BIN / "fusedserve"), "embed", *TINY, "hello")
    assert result.returncode == 0, result.stderr
    assert "kernel backends" in result.stderr  # the start-up report
    (hint,) = [line for line in result.stderr.splitlines() if "fusedserve serve" in line]
    assert "/infer" in hint and "--quiet" in hint
    assert [json.loads(line)["text"] for line in result.stdout.splitlines()] == ["hello"]

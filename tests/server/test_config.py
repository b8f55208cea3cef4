"""Settings: a setting removed in this release starts with a warning naming it (from the environment or the
config file), for one release; anything else unknown still fails at start naming it."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from server.config import REMOVED_SETTINGS, Settings


def test_removed_settings_start_with_a_warning_from_the_environment_and_the_file(monkeypatch, tmp_path, caplog):
    config = tmp_path / "fusedserve.yaml"
    config.write_text("layout: padded\nfault_injection: true\nmax_wait_ms: 3\n")
    monkeypatch.setenv("FUSEDSERVE_CONFIG", str(config))
    monkeypatch.setenv("FUSEDSERVE_IDLE_POLL_MS", "1")
    monkeypatch.setenv("FUSEDSERVE_GIL_SWITCH_INTERVAL_MS", "0.5")
    with caplog.at_level(logging.WARNING, logger="fusedserve"):
        settings = Settings()
    assert settings.max_wait_ms == 3  # the rest of the file still applies
    warned = caplog.text
    for key in REMOVED_SETTINGS:
        assert f"setting {key} (FUSEDSERVE_{key.upper()}) was removed and is ignored" in warned, warned
    assert not hasattr(settings, "layout")


def test_an_unknown_setting_in_the_file_still_fails_naming_it(monkeypatch, tmp_path):
    config = tmp_path / "fusedserve.yaml"
    config.write_text("max_wait_msec: 3\n")
    monkeypatch.setenv("FUSEDSERVE_CONFIG", str(config))
    with pytest.raises(ValidationError, match="max_wait_msec"):
        Settings()

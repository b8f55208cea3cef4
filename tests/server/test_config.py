"""Settings: a setting removed in this release starts with a warning naming it (from the environment or the
config file), for one release; anything else unknown still fails at start naming it. Several models: `models` from
the environment (`name=path,...`) or a file (a mapping, with per-model settings), in order; bad values fail naming
the setting."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from fusedserve.server.config import REMOVED_SETTINGS, Settings


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


def test_models_from_the_environment_and_from_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEDSERVE_MODELS", "minilm=default, reranker=/models/ce")
    settings = Settings()
    assert [(name, spec.path) for name, spec in settings.served_models()] == [("minilm", "default"),
                                                                              ("reranker", "/models/ce")]
    monkeypatch.delenv("FUSEDSERVE_MODELS")
    config = tmp_path / "fusedserve.yaml"
    config.write_text("models:\n  e5: {path: /models/e5, max_seq_length: 512, pooling: cls}\n  minilm: default\n"
                      "model_load_failure: skip\npooling: mean\n")
    monkeypatch.setenv("FUSEDSERVE_CONFIG", str(config))
    settings = Settings()
    (first, e5), (second, minilm) = settings.served_models()  # in the file's order: the first is the default
    assert (first, e5.path, e5.max_seq_length, e5.pooling) == ("e5", "/models/e5", 512, "cls")
    assert (second, minilm.path, minilm.pooling) == ("minilm", "default", None)  # the server-wide pooling applies
    assert settings.model_load_failure == "skip"


def test_one_model_when_models_is_empty():
    assert [(name, spec.path) for name, spec in Settings().served_models()] == [(None, "default")]
    assert [(name, spec.path) for name, spec in Settings(model="tiny", model_name="t").served_models()] == \
        [("t", "tiny")]


@pytest.mark.parametrize("value,error", [
    ("minilm", "expected name=path pairs"),
    ("a=x,a=y", "model name 'a' given twice"),
    ("org/model=x", "model name 'org/model'"),
    ("=x", "expected name=path pairs"),
])
def test_bad_models_fail_naming_the_setting(value, error):
    with pytest.raises(ValidationError, match="models") as failure:
        Settings(models=value)
    assert error in str(failure.value)


def test_models_and_model_are_not_set_together(monkeypatch):
    monkeypatch.setenv("FUSEDSERVE_MODEL", "tiny")
    with pytest.raises(ValidationError, match="set either models"):
        Settings(models="a=default")
    with pytest.raises(ValidationError, match="model_load_failure"):
        Settings(model_load_failure="ignore")


BOOL_SETTINGS = sorted(name for name, field in Settings.model_fields.items() if field.annotation is bool)


def test_there_are_bool_settings_to_check():
    assert {"fused", "warmup", "cuda_graphs", "auth_probes"} <= set(BOOL_SETTINGS)


@pytest.mark.parametrize("name", BOOL_SETTINGS)
@pytest.mark.parametrize("value,expected", [("true", True), ("TRUE", True), ("True", True), ("1", True),
                                            ("false", False), ("False", False), ("FALSE", False), ("0", False)])
def test_bool_settings_take_true_false_1_0_in_any_case(monkeypatch, name, value, expected):
    monkeypatch.setenv(f"FUSEDSERVE_{name.upper()}", value)
    assert getattr(Settings(), name) is expected


@pytest.mark.parametrize("name", BOOL_SETTINGS)
@pytest.mark.parametrize("value", ["yes", "no", "on", "off", "y", "t", "2", "enabled", ""])
def test_bool_settings_refuse_other_words_naming_the_setting(monkeypatch, name, value):
    """pydantic alone reads yes/no/on/off as booleans; docs/configuration.md lists true and false."""
    monkeypatch.setenv(f"FUSEDSERVE_{name.upper()}", value)
    with pytest.raises(ValidationError, match=rf"{name} takes true, false, 1 or 0 \(any case\), not '{value}'"):
        Settings()


def test_bool_settings_from_a_file_and_from_code(monkeypatch, tmp_path):
    """A file's own booleans are booleans; a quoted word in it is held to the same words as the environment."""
    config = tmp_path / "fusedserve.yaml"
    config.write_text("fused: false\nwarmup: 'TRUE'\n")
    monkeypatch.setenv("FUSEDSERVE_CONFIG", str(config))
    settings = Settings()
    assert settings.fused is False and settings.warmup is True
    config.write_text("fused: 'yes'\n")
    with pytest.raises(ValidationError, match="fused takes true, false, 1 or 0"):
        Settings()
    monkeypatch.delenv("FUSEDSERVE_CONFIG")
    assert (Settings(fused=False, warmup=0).fused, Settings(warmup=0).warmup) == (False, False)
    with pytest.raises(ValidationError, match="warmup takes"):
        Settings(warmup=2.0)

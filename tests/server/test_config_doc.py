"""docs/configuration.md is generated from Settings (server.config_doc): the committed page must be what the
generator writes now, and every setting must be documented there with a description."""

from __future__ import annotations

from server import config_doc
from server.config import REMOVED_SETTINGS, Settings


def test_the_committed_configuration_page_is_current():
    assert config_doc.DOC.is_file(), "docs/configuration.md is missing: python -m server.config_doc --write"
    assert config_doc.DOC.read_text() == config_doc.render(), \
        "docs/configuration.md is stale: run python -m server.config_doc --write and commit it"


def test_every_setting_and_every_removed_one_is_on_the_page():
    page = config_doc.render()
    for name in [*Settings.model_fields, *REMOVED_SETTINGS]:
        assert f"| `FUSEDSERVE_{name.upper()}` |" in page, name


def test_every_setting_has_a_description():
    undescribed = [n for n, f in Settings.model_fields.items() if not config_doc.description(n, f)]
    assert not undescribed, f"settings without a description (Field(description=...) in server/config.py): {undescribed}"


def test_the_generator_keeps_no_stale_stand_ins():
    """Its stand-ins (advanced names, descriptions) are for fields that lack the metadata in server/config.py; once a
    field carries its own, the stand-in must go, so each text lives in one place."""
    fields = Settings.model_fields
    unknown = sorted(set(config_doc.ADVANCED_UNMARKED) | set(config_doc.MISSING_DESCRIPTIONS))
    unknown = [n for n in unknown if n not in fields]
    assert not unknown, f"server/config_doc.py names settings that do not exist: {unknown}"
    described = [n for n in config_doc.MISSING_DESCRIPTIONS if fields[n].description]
    assert not described, f"delete from server/config_doc.py MISSING_DESCRIPTIONS (config.py has them now): {described}"
    marked = [n for n in config_doc.ADVANCED_UNMARKED
              if isinstance(fields[n].json_schema_extra, dict) and fields[n].json_schema_extra.get("advanced")]
    assert not marked, f"delete from server/config_doc.py ADVANCED_UNMARKED (marked in config.py now): {marked}"


def test_check_mode_fails_on_a_stale_page(tmp_path, monkeypatch):
    stale = tmp_path / "configuration.md"
    stale.write_text(config_doc.render().replace("FUSEDSERVE_MODEL", "FUSEDSERVE_MODLE", 1))
    monkeypatch.setattr(config_doc, "DOC", stale)
    assert config_doc.main(["--check"]) == 1
    assert config_doc.main(["--write"]) == 0
    assert config_doc.main(["--check"]) == 0

"""docs/configuration.md is generated from Settings (server.config_doc): the committed page must be what the
generator writes now, and every setting must be documented there with a description."""

from __future__ import annotations

from fusedserve.server import config_doc
from fusedserve.server.config import REMOVED_SETTINGS, Settings


def test_the_committed_configuration_page_is_current():
    assert config_doc.DOC.is_file(), "docs/configuration.md is missing: python -m fusedserve.server.config_doc --write"
    assert config_doc.DOC.read_text() == config_doc.render(), \
        "docs/configuration.md is stale: run python -m fusedserve.server.config_doc --write and commit it"


def test_every_setting_and_every_removed_one_is_on_the_page():
    page = config_doc.render()
    for name in [*Settings.model_fields, *REMOVED_SETTINGS]:
        assert f"| `FUSEDSERVE_{name.upper()}` |" in page, name


def test_every_setting_has_a_description():
    undescribed = [n for n, f in Settings.model_fields.items() if not config_doc.description(n, f)]
    assert not undescribed, f"settings without a description (Field(description=...) in server/config.py): {undescribed}"


def test_check_mode_fails_on_a_stale_page(tmp_path, monkeypatch):
    stale = tmp_path / "configuration.md"
    stale.write_text(config_doc.render().replace("FUSEDSERVE_MODEL", "FUSEDSERVE_MODLE", 1))
    monkeypatch.setattr(config_doc, "DOC", stale)
    assert config_doc.main(["--check"]) == 1
    assert config_doc.main(["--write"]) == 0
    assert config_doc.main(["--check"]) == 0

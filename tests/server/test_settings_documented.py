"""Every service setting is documented in the README's settings table (name and default), so operators never
meet an undocumented FUSEDSERVE_* variable."""

from __future__ import annotations

import re
from pathlib import Path

from server.config import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_has_a_readme_row():
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| ([^|]+) \|", README, flags=re.MULTILINE))
    missing = [name.upper() for name in Settings.model_fields if name.upper() not in rows]
    assert not missing, f"settings without a README row: {missing}"
    for name, field in Settings.model_fields.items():
        default = field.default
        if isinstance(default, bool):
            assert rows[name.upper()].strip() == f"`{str(default).lower()}`", name
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            assert float(rows[name.upper()].strip()) == default, name

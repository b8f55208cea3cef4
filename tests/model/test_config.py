"""EncoderConfig: a family's own section (its hyper-parameters no other family reads) rides in the config, compared
and hashed with it, as the shared fields are."""

from __future__ import annotations

from dataclasses import dataclass

from fusedserve.model.config import EncoderConfig


@dataclass(frozen=True)
class _Section:
    buckets: int
    kinds: tuple[str, ...]


def test_a_family_section_rides_in_the_config():
    config = EncoderConfig(section=_Section(8, ("c2p", "p2c")))
    assert config.replace(max_seq_length=64).section == _Section(8, ("c2p", "p2c"))
    assert config != EncoderConfig(section=_Section(16, ("c2p", "p2c")))
    assert hash(config) == hash(EncoderConfig(section=_Section(8, ("c2p", "p2c"))))
    assert EncoderConfig().section is None

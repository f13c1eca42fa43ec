"""docs/configuration.md is the schema's reference, generated from it (`harness.config.reference`):
a key added, renamed, re-defaulted or re-described in harness/config/schema.py without the
document, or the document edited by hand, fails here. Both tests read source only (< 1 s)."""

from __future__ import annotations

from pathlib import Path

from harness.config import RunConfig, all_keys
from harness.config.reference import reference_markdown, undocumented

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_configuration_reference_is_the_schemas():
    assert DOC.read_text() == reference_markdown(), (
        "docs/configuration.md and harness/config/schema.py disagree: edit the schema's field comments, then "
        "run `python -m harness.config --reference > docs/configuration.md`"
    )


def test_every_key_is_in_the_reference_and_documented():
    text = DOC.read_text()
    missing = [key for key in all_keys(RunConfig) if f"| `{key}` |" not in text]
    assert not missing, f"keys the reference does not list: {missing}"
    # The prune section's keys are documented by its owner (its fields are being redesigned); every
    # other key must say what it means.
    assert [key for key in undocumented() if not key.startswith("prune.")] == []

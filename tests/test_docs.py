"""The documents stay true to the code: every config key is documented, and links between them resolve."""

import dataclasses
import re
from pathlib import Path

from tformer_cli.config import SECTIONS

ROOT = Path(__file__).resolve().parent.parent


def _documented_keys() -> list[str]:
    """The keys in the first column of docs/config.md's table: `section.key`, then bare `key`s of the
    same section (`model.d_model`, `num_heads`)."""
    keys = []
    for line in (ROOT / "docs" / "config.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([^`]+)`", line.split("|")[1])
        section = names[0].split(".")[0]
        keys += [names[0]] + [f"{section}.{name}" for name in names[1:]]
    return keys


def test_every_config_key_is_documented_once_and_no_other():
    keys = _documented_keys()
    fields = [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert sorted(keys) == sorted(fields)


def test_links_between_the_documents_resolve():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to missing {target}"

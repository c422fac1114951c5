"""The key table of docs/config.md, generated from the config dataclasses and the comments on their
fields, so that the reference cannot drift from the code (tests/test_docs.py checks it):

    python -m tformer_cli.config_doc      # prints the table; paste it over the one in docs/config.md
"""

from __future__ import annotations

import dataclasses
import inspect
import re

from tformer_cli.config import SECTIONS


def key_table() -> str:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for section, cls in SECTIONS.items():
        comments = field_comments(cls)
        for field in dataclasses.fields(cls):
            meaning = comments.get(field.name, "").replace("|", "/")
            rows.append(f"| `{section}.{field.name}` | {_type(str(field.type))} | {_default(field)} | {meaning} |")
    return "\n".join(rows) + "\n"


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: the comment lines right above it and the one after it, joined."""
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").rstrip())
            continue
        match = re.match(r"\s{4}(\w+):[^#]*(?:#\s*(.*))?$", line)
        if match:
            comments[match.group(1)] = " ".join(above + ([match.group(2).strip()] if match.group(2) else []))
        above = []
    return comments


def _type(annotation: str) -> str:
    choices = re.fullmatch(r"Literal\[(.*)\]", annotation)
    if choices:
        names = (c.strip().strip(chr(34) + chr(39)) for c in choices.group(1).split(","))
        return " / ".join(f"`{name.lower() if name in ('True', 'False') else name}`" for name in names)  # as in YAML
    optional = re.fullmatch(r"Optional\[(.*)\]", annotation)
    return f"{_type(optional.group(1))} or null" if optional else annotation.replace("|", "/")


def _default(field: dataclasses.Field) -> str:
    value = field.default_factory() if field.default is dataclasses.MISSING else field.default  # type: ignore[misc]
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


if __name__ == "__main__":
    print(key_table(), end="")

"""From YAML text and ``--set`` items to typed config sections: ``extends``, overrides, type checks.

``tformer_cli.config`` defines the sections (dataclasses) and validates their values; this module
turns raw YAML into them, recording every mistake as one line naming its key path. No torch here.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from tformer_cli.errors import ConfigError, brief, first_line


class _KeyGivenTwice(yaml.constructor.ConstructorError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last, and the
    first value (a whole section, say) would be lost without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *base": its keys may be given again
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue  # refused by PyYAML's own construct_mapping
            if key in keys:
                raise _KeyGivenTwice(None, None, f"{_quoted(key)} is given twice; keep one", key_node.start_mark)
            keys.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: Path, sections: typing.Collection[str], seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The file's mapping of sections, merged over the file it ``extends`` (relative to it).

    Raises:
        ConfigError: a missing file, invalid YAML, a non-mapping, or a cycle of ``extends``.
    """
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "config file not found"
        raise ConfigError(f"{path}: {what}; pass an existing YAML file such as configs/base.yaml")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'extends' forms a cycle; remove one of the extends lines")
    try:
        data = yaml.load(path.read_bytes().decode("utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save the file as UTF-8") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {first_line(getattr(exc, 'problem', None) or exc)}") from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty; write the sections to change ({', '.join(sections)}), "
                          "e.g. start from configs/base.yaml")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections ({', '.join(sections)})")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"{path}: extends: expected a file name, got {brief(parent)}")
    base = read_yaml(path.parent / parent, sections, seen + (path.resolve(),))
    return merge(base, data, sections)


def merge(base: dict[str, Any], update: dict[str, Any], sections: typing.Collection[str]) -> dict[str, Any]:
    """``update`` over ``base``, key by key within each section."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key in sections:
            merged[key] = merge(merged[key], value, sections)
        else:
            merged[key] = value
    return merged


def apply_override(raw: dict[str, Any], item: str, errors: list[str]) -> str | None:
    """Set ``section.key=value`` in ``raw``, or ``section.key.entry=value`` in a mapping-valued key such
    as ``data.data_files.train``; returns ``section.key``, or None after recording a malformed item."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) not in (2, 3) or not all(parts):
        errors.append(f"--set {item!r}: expected section.key=value, e.g. --set train.lr=3e-4 "
                      f"(or section.key.entry=value for a mapping such as data.data_files.train)")
        return None
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader) if text.strip() else None
    except _KeyGivenTwice as exc:  # in a mapping value: a mistake, as in a file
        errors.append(f"--set {shown_key(key.strip())}: {exc.problem}")
        return None
    except yaml.YAMLError:
        value = text
    section = raw.setdefault(parts[0], {})
    if not isinstance(section, dict):
        return None  # build_sections reports the section itself
    if len(parts) == 3:
        mapping = section.get(parts[1])
        section[parts[1]] = mapping = dict(mapping) if isinstance(mapping, dict) else {}
        mapping[parts[2]] = value
    else:
        section[parts[1]] = value
    return ".".join(parts[:2])


def origin(error: str, overridden: set[str], source: str, flags: dict[str, str]) -> str:
    """The error prefixed by where the mistake is: a command's option, a --set item, or else the file (or
    command line)."""
    if error.startswith("--set "):
        return error
    key, _, problem = error.partition(": ")  # key: e.g. data.data_files.train, from --set data.data_files=...
    if key not in flags and not _set_by(key, overridden):  # a check of two keys: the mistake of the one set
        named = next((k for k in (*flags, *overridden) if _names(problem, k, key)), None)
        if named:
            problem = problem if _names(problem, key, key) else f"{key} {problem}"  # what was checked
            key = named
    if key in flags:
        return f"{flags[key]}: {problem}"
    return f"--set {key}: {problem}" if _set_by(key, overridden) else f"{source}: {error}"


def _names(problem: str, key: str, of: str) -> bool:
    """Whether ``problem``, an error of the key ``of``, names ``key``: in full (``model.max_len``), or by
    its name alone (``num_heads``) where the two keys are of one section."""
    section, _, name = key.rpartition(".")
    spellings = (key, name) if of.rpartition(".")[0] == section else (key,)
    return any(re.search(rf"(?<![\w.]){re.escape(spelling)}\b", problem) for spelling in spellings)


def _set_by(key: str, overridden: set[str]) -> bool:
    """Whether one of the ``--set`` items ``overridden`` set ``key`` (or the mapping holding it)."""
    return any(key == o or key.startswith(o + ".") for o in overridden)


def build_sections(raw: dict[str, Any], sections: dict[str, type],
                   errors: list[str]) -> tuple[dict[str, Any], set[str]]:
    """One dataclass instance per section of ``sections`` (defaults where ``raw`` lacks it), after
    recording every unknown section or key and every value of the wrong type in ``errors``. Returns the
    sections, a wrong value left at its default, and the keys (``model.d_model``) whose values were wrong
    or misspelt, so that the values' own checks can still run on the rest."""
    built: dict[str, Any] = {}
    wrong: set[str] = set()
    for name, value in raw.items():
        if name not in sections:
            errors.append(f"unknown section {_quoted(name)}{_suggest(name, sections)} (sections: {', '.join(sections)})")
            continue
        if value is None:
            value = {}
        if not isinstance(value, dict):
            errors.append(f"{name}: expected a mapping of keys, got {type(value).__name__}")
            wrong |= {f"{name}.{f.name}" for f in dataclasses.fields(sections[name])}
            continue
        built[name] = _build_section(name, sections[name], value, errors, wrong)
    return {name: built.get(name, cls()) for name, cls in sections.items()}, wrong


def _build_section(name: str, cls: type, values: dict[str, Any], errors: list[str], wrong: set[str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            errors.append(f"{name}.{shown_key(key)}: unknown key{_suggest(key, fields)}")
            wrong.update(f"{name}.{meant}" for meant in difflib.get_close_matches(str(key), list(fields), n=1))
            continue
        problem, value = check_type(value, hints[key])
        if problem:
            errors.append(f"{name}.{key}: {problem}")
            wrong.add(f"{name}.{key}")
            continue
        kwargs[key] = value
    return cls(**kwargs)


def shown_key(name: Any) -> str:
    """A key as written, or quoted (and cut short) where it would break the one-line message."""
    return name if isinstance(name, str) and name.isprintable() and 0 < len(name) <= 60 else brief(name)


def _quoted(name: Any) -> str:
    return f"'{name}'" if shown_key(name) == name else shown_key(name)


def _suggest(name: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(str(name), list(options), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


# the words PyYAML reads as false and true (in any case): a choice spelled so arrives as a boolean
_YAML_BOOL_WORDS = {False: ("off", "no", "false"), True: ("on", "yes", "true")}


def check_type(value: Any, hint: Any) -> tuple[str | None, Any]:
    """Return (problem or None, value coerced to the hint, e.g. int -> float)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None, None
        inner = [a for a in args if a is not type(None)]
        return check_type(value, inner[0]) if len(inner) == 1 else (None, value)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):  # 1 is not true
            return None, value
        choices = ", ".join(str(a).lower() if isinstance(a, bool) else repr(a) for a in args)  # as in YAML
        if isinstance(value, bool):  # the user wrote a word (`accel: off`) that YAML read as a boolean
            spellings = _YAML_BOOL_WORDS[value]
            if words := [a for a in args if a in spellings]:
                return None, words[0]  # the choice the user wrote
            word = str(value).lower()
            return f"must be one of {choices}, got {word} (YAML reads {', '.join(spellings)} as {word})", value
        return f"must be one of {choices}, got {brief(value)}{_suggest(str(value), map(str, args))}", value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return f"expected a list, got {brief(value)}", value
        checked = [check_type(v, args[0]) for v in value]
        problems = [p for p, _ in checked if p]
        return (problems[0] if problems else None), [v for _, v in checked]
    if origin is dict:
        return (None, value) if isinstance(value, dict) else (f"expected a mapping, got {brief(value)}", value)
    if hint is bool:
        return (None, value) if isinstance(value, bool) else (f"expected true or false, got {brief(value)}", value)
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"expected an integer, got {brief(value)}", value
        return (None, value) if abs(value) < 2 ** 63 else (f"expected a 64-bit integer, got {brief(value)}", value)
    if hint is float:
        number = None
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):  # YAML 1.1 reads 3e-4 as a string
            try:
                number = float(value)
            except ValueError:
                pass
            except OverflowError:  # an integer past float's range
                number = math.inf
        if number is None:
            return f"expected a number, got {brief(value)}", value
        return (None, number) if math.isfinite(number) else (f"expected a finite number, got {brief(value)}", value)
    if hint is str:
        if isinstance(value, str):
            return None, value
        scalar = value is None or isinstance(value, (bool, int, float))  # what YAML made of unquoted text
        quote = " (YAML reads yes, no, on, off, ~ and numbers as other types); put the text in quotes" if scalar else ""
        return f"expected a string, got {brief(value)}{quote}", value
    return None, value

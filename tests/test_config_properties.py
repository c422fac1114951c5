"""Property-based tests (hypothesis) of the config loader and ``--set``: whatever the YAML or the
override, the result is a valid Config or a ConfigError whose every line names where the mistake is."""

import dataclasses
import math

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tformer_cli.config import SECTIONS, load_config, to_yaml
from tformer_cli.errors import ConfigError

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12))
yaml_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=8), inner, max_size=3), max_leaves=8)
key_names = st.sampled_from([f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)] + ["nope", ""]) \
    | st.text(max_size=6) | st.integers()
section_names = st.sampled_from(list(SECTIONS) + ["modle", "extra"]) | st.integers()


def _loads_or_names_the_mistake(path, overrides=()) -> None:
    try:
        config = load_config(path, list(overrides))
    except ConfigError as exc:
        lines = str(exc).splitlines()
        assert lines and all(line.startswith((f"{path}: ", "--set ")) for line in lines), lines
    else:
        reloaded = path.with_name("again.yaml")
        reloaded.write_text(to_yaml(config))
        assert load_config(reloaded) == dataclasses.replace(config, name="again")  # what is saved loads back


@FAST
@given(document=st.dictionaries(section_names, st.dictionaries(key_names, yaml_values, max_size=4) | yaml_values,
                                max_size=4))
def test_any_yaml_document_loads_or_is_a_config_error(tmp_path, document):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(document, allow_unicode=True))
    _loads_or_names_the_mistake(path)


@FAST
@given(text=st.text(max_size=200))
def test_any_text_loads_or_is_a_config_error(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _loads_or_names_the_mistake(path)


@FAST
@given(items=st.lists(st.tuples(section_names, key_names, st.text(max_size=10)), max_size=4),
       raw=st.lists(st.text(max_size=20), max_size=2))
def test_any_set_item_applies_or_is_a_config_error(tmp_path, items, raw):
    path = tmp_path / "c.yaml"
    path.write_text("train: {max_steps: 10}\ndata: {dataset: somewhere}\n")
    _loads_or_names_the_mistake(path, [f"{s}.{k}={v}" for s, k, v in items] + raw)


@FAST
@given(heads=st.integers(1, 16), width=st.integers(1, 64), lr=st.floats(1e-9, 10), steps=st.integers(1, 10**9))
def test_a_valid_set_item_sets_exactly_its_key(tmp_path, heads, width, lr, steps):
    path = tmp_path / "c.yaml"
    path.write_text("train: {max_steps: 10}\ndata: {dataset: somewhere}\n")
    config = load_config(path, [f"model.num_heads={heads}", f"model.d_model={heads * width * 2}",
                                f"train.lr={lr!r}", f"train.max_steps={steps}"])
    assert (config.model.num_heads, config.model.d_model, config.train.max_steps) == (heads, heads * width * 2, steps)
    assert math.isclose(config.train.lr, lr)
    untouched = load_config(path)
    assert config.data == untouched.data and config.decode == untouched.decode

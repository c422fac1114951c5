import gzip
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tformer_cli.batching import collate, token_batches
from tformer_cli.config import DataConfig
from tformer_cli.data import load_pairs, pin_revision
from tformer_cli.data_paths import absolute_paths
from tformer_cli.encoding import (
    EncodedSplit, cached_vocabulary, data_fingerprint, encode_split, encodings_cached, joined, load_encoded, resegment,
    split_counts, split_from_tensors, split_tensors, train_or_load_vocabulary)
from tformer_cli.errors import DataError
from tformer_cli.preparing import prepare_apart
from tformer_cli.tokenizer import PAD_ID, Vocabulary

ROWS = [{"de": f"ein Haus {i}", "en": f"a house {i}"} for i in range(12)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return str(path)


def test_a_line_that_is_not_json_names_its_file_and_prints_nothing_else(tmp_path, capfd):
    folder = tmp_path / "corpus"
    folder.mkdir()
    _jsonl(folder / "validation.jsonl", ROWS)
    (folder / "train.jsonl").write_text(open(_jsonl(folder / "train.jsonl", ROWS)).read() + '{"de": "x"\n')
    parser = r"JSON parse error: Missing a comma or '}' after an object member"  # pyarrow's words, not pandas'
    with pytest.raises(DataError, match=rf"could not read .*corpus/train.jsonl of the dataset folder .*: {parser}"):
        load_pairs(DataConfig(dataset=str(folder), source="de", target="en"), "train")
    with pytest.raises(DataError, match=rf"could not read .*corpus/train.jsonl as json: {parser}"):
        load_pairs(DataConfig(data_files={"train": str(folder / "train.jsonl")}, source="de", target="en"), "train")
    assert capfd.readouterr().err == ""  # datasets logs the file it failed on: that line is not shown
    import logging

    import datasets

    quiet = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # as DATASETS_VERBOSITY=critical sets it
    logging.getLogger("datasets.packaged_modules.json.json").isEnabledFor(logging.ERROR)  # cached: off
    try:
        with pytest.raises(DataError, match=r"could not read .*corpus/train.jsonl of the dataset folder"):
            load_pairs(DataConfig(dataset=str(folder), source="de", target="en"), "train")
    finally:
        datasets.logging.set_verbosity(quiet)


def test_jsonl_csv_parquet_and_gzip_give_the_same_pairs(tmp_path):
    import pandas as pd

    expected = [(r["de"], r["en"]) for r in ROWS]
    jsonl = _jsonl(tmp_path / "train.jsonl", ROWS)
    pd.DataFrame(ROWS).to_csv(tmp_path / "train.csv", index=False)
    pd.DataFrame(ROWS).to_parquet(tmp_path / "train.parquet")
    with gzip.open(tmp_path / "train.jsonl.gz", "wt") as f:
        f.write(open(jsonl).read())
    for name in ("train.jsonl", "train.csv", "train.parquet", "train.jsonl.gz"):
        cfg = DataConfig(data_files={"train": str(tmp_path / name)}, source="de", target="en")
        assert load_pairs(cfg, "train") == expected, name


def test_glob_patterns_read_the_files_they_match_in_order_and_the_run_records_them(tmp_path, monkeypatch):
    shards = tmp_path / "shards"
    (shards / "more").mkdir(parents=True)
    for i, name in enumerate(["train-10.jsonl", "train-02.jsonl", "more/train-03.jsonl"]):  # written out of order
        _jsonl(shards / name, ROWS[4 * i:4 * i + 4])
    (shards / "train-99.jsonl").mkdir()  # a folder that matches is not a file to read
    monkeypatch.chdir(tmp_path)
    patterns = {"shards/train-*.jsonl": ROWS[4:8] + ROWS[0:4],  # train-02, then train-10
                ("shards/**/train-03.jsonl", "shards/train-1?.jsonl"): ROWS[8:12] + ROWS[0:4]}
    for pattern, rows in patterns.items():
        cfg = DataConfig(data_files={"train": list(pattern) if isinstance(pattern, tuple) else pattern})
        assert load_pairs(replace(cfg, source="de", target="en"), "train") == [(r["de"], r["en"]) for r in rows]
    cfg = DataConfig(data_files={"train": "shards/**/train-*.jsonl"})
    key = data_fingerprint(cfg, "train")
    _jsonl(shards / "more/train-03.jsonl", ROWS[8:13])  # a matched file changed: the cache key with it
    assert data_fingerprint(cfg, "train") != key
    cfg = absolute_paths(DataConfig(data_files={"train": "shards/train-*.jsonl", "test": "shards/train-02.jsonl"}))
    assert cfg.data_files == {"train": [str(shards / "train-02.jsonl"), str(shards / "train-10.jsonl")],
                              "test": str(shards / "train-02.jsonl")}  # a run's config.yaml names what it read
    (tmp_path / "[draft].jsonl").write_text(json.dumps(ROWS[0]) + "\n")  # a file's own name, brackets and all
    assert load_pairs(DataConfig(data_files={"train": "[draft].jsonl"}, source="de", target="en"), "train") == [
        (ROWS[0]["de"], ROWS[0]["en"])]
    for name in ("train.en", "train.de"):  # a text split's [source, target] order is not one a pattern can say
        (tmp_path / name).write_text("a house\n")
    with pytest.raises(DataError, match=r"^data.data_files: train.\* matches plain-text files \(train.de, train.en\), "
                                        r"whose order says which is the source; name them one by one, \[source, "):
        absolute_paths(DataConfig(data_files={"train": "train.*"}))
    with pytest.raises(DataError, match=r"^no data file matches shards/nothing-\*.jsonl; fix data.data_files"):
        load_pairs(DataConfig(data_files={"train": ["shards/train-02.jsonl", "shards/nothing-*.jsonl"]}), "train")


def test_a_file_rewritten_with_the_same_time_of_change_is_read_again(tmp_path):
    """datasets keys its cache of a local file by the file's time of change, which a file rewritten
    within one tick of the clock keeps: it gave back the earlier table."""
    rows = [{"de": f"d{i}", "en": f"e{i}"} for i in range(5)]
    for name, write in (("t.jsonl", lambda path, r: _jsonl(path, r)),
                        ("t.tsv", lambda path, r: path.write_text("".join(f"{x['de']}\t{x['en']}\n" for x in r)))):
        path = tmp_path / name
        cfg = DataConfig(data_files={"train": str(path)}, source="de", target="en")
        for count in (3, 5):  # the second version is longer, with the first's time of change
            write(path, rows[:count])
            os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
            assert load_pairs(cfg, "train") == [(r["de"], r["en"]) for r in rows[:count]], (name, count)
    folder = tmp_path / "corpus"  # a dataset folder, which datasets loads by itself
    folder.mkdir()
    for count in (3, 5):
        _jsonl(folder / "train.jsonl", rows[:count])
        os.utime(folder / "train.jsonl", ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
        assert load_pairs(DataConfig(dataset=str(folder), source="de", target="en"), "train") == \
            [(r["de"], r["en"]) for r in rows[:count]], ("folder", count)


def test_tab_separated_pairs_with_or_without_a_header(tmp_path):
    rows = [*ROWS, {"de": 'er sagte "ja"', "en": 'he said "yes"'}, {"de": "42", "en": "42"}]  # quotes are text
    lines = [f"{r['de']}\t{r['en']}\tCC-BY 2.0 (France) Attribution: tatoeba.org\n" for r in rows]
    (tmp_path / "plain.tsv").write_text("".join(lines))
    (tmp_path / "header.tsv").write_text("de\ten\n" + "".join(lines))
    (tmp_path / "excel.tsv").write_text("\ufeffde\ten\n" + "".join(lines))  # a byte-order mark before the header
    with gzip.open(tmp_path / "plain.tsv.gz", "wt") as f:
        f.write("".join(lines))
    expected = [(r["de"], r["en"]) for r in rows]
    for files in (["plain.tsv"], ["header.tsv"], ["excel.tsv"], ["plain.tsv.gz"], ["header.tsv", "plain.tsv"]):
        cfg = DataConfig(data_files={"train": [str(tmp_path / f) for f in files]}, source="de", target="en")
        assert load_pairs(cfg, "train") == expected * len(files), files
    (tmp_path / "pairs.data").write_text("".join(lines))
    assert load_pairs(DataConfig(data_files={"train": str(tmp_path / "pairs.data")}, format="tsv", source="de",
                                 target="en"), "train") == expected
    folder = tmp_path / "corpus"  # a dataset folder of SPLIT.tsv files
    folder.mkdir()
    (tmp_path / "plain.tsv").rename(folder / "train.tsv")
    (tmp_path / "header.tsv").rename(folder / "validation.tsv")
    for split in ("train", "validation"):
        assert load_pairs(DataConfig(dataset=str(folder), source="de", target="en"), split) == expected
    with pytest.raises(DataError, match=r"has no test.tsv \(has: train.tsv, validation.tsv\)"):
        load_pairs(DataConfig(dataset=str(folder), source="de", target="en"), "test")
    mixed = tmp_path / "mixed"  # jsonl data and a stray .tsv: datasets reads the jsonl, as before .tsv was known
    mixed.mkdir()
    _jsonl(mixed / "train.jsonl", ROWS)
    (mixed / "notes.tsv").write_text("a\tb\n")
    assert load_pairs(DataConfig(dataset=str(mixed), source="de", target="en"), "train") == expected[:len(ROWS)]
    _jsonl(mixed / "validation.jsonl", ROWS)  # a split in two formats: either would leave the other out
    (mixed / "validation.tsv").write_text("a\tb\n")
    with pytest.raises(DataError, match=r"holds split 'validation' in 2 formats \(validation.jsonl, validation.tsv\)"):
        load_pairs(DataConfig(dataset=str(mixed), source="de", target="en"), "validation")
    assert load_pairs(DataConfig(dataset=str(mixed), source="de", target="en"), "train") == expected[:len(ROWS)]
    unnamed = tmp_path / "unnamed"  # no file named for a split: the data's format read, a note beside it left
    unnamed.mkdir()
    _jsonl(unnamed / "pairs.jsonl", ROWS)
    (unnamed / "notes.txt").write_text("from tatoeba\n")
    assert load_pairs(DataConfig(dataset=str(unnamed), source="de", target="en"), "train") == expected[:len(ROWS)]
    twice = tmp_path / "twice"  # a file beside its gzipped copy: datasets reads both, every pair twice
    twice.mkdir()
    _jsonl(twice / "train.jsonl", ROWS)
    with open(twice / "train.jsonl", "rb") as f, gzip.open(twice / "train.jsonl.gz", "wb") as g:
        g.write(f.read())
    with pytest.raises(DataError, match=r"holds both train.jsonl and train.jsonl.gz, which would both be read"):
        load_pairs(DataConfig(dataset=str(twice), source="de", target="en"), "train")


def test_parallel_text_files_and_nested_fields(tmp_path):
    (tmp_path / "train.de").write_text("".join(r["de"] + "\n" for r in ROWS))
    (tmp_path / "train.en").write_text("".join(r["en"] + "\n" for r in ROWS))
    files = [str(tmp_path / "train.de"), str(tmp_path / "train.en")]
    for fmt in ("text", "auto"):  # auto: two files named by their languages are a text pair
        assert load_pairs(DataConfig(data_files={"train": files}, format=fmt), "train") == [(r["de"], r["en"]) for r in ROWS]
    for file in files:  # as Notepad saves UTF-8: a byte-order mark first, which is no part of the first line
        Path(file).write_bytes(b"\xef\xbb\xbf" + Path(file).read_bytes())
    assert load_pairs(DataConfig(data_files={"train": files}), "train") == [(r["de"], r["en"]) for r in ROWS]
    with pytest.raises(DataError, match=r"cannot tell the format of '.*train\.de' from its extension"):
        load_pairs(DataConfig(data_files={"train": files[:1]}), "train")
    nested = _jsonl(tmp_path / "wmt.jsonl", [{"translation": r} for r in ROWS])
    cfg = DataConfig(data_files={"train": nested}, source="translation.de", target="translation.en", max_samples=5)
    assert load_pairs(cfg, "train") == [(r["de"], r["en"]) for r in ROWS[:5]]


def test_local_dataset_folder_with_split_names(tmp_path):
    _jsonl(tmp_path / "train.jsonl", ROWS)
    _jsonl(tmp_path / "validation.jsonl", ROWS[:3])
    cfg = DataConfig(dataset=str(tmp_path), source="en", target="de")
    assert len(load_pairs(cfg, "validation")) == 3
    with pytest.raises(DataError, match=r"has no split 'test' \(has: train, validation\)"):
        load_pairs(cfg, "test")


def test_bad_data_configs_give_clear_errors(tmp_path):
    good = _jsonl(tmp_path / "train.jsonl", ROWS)
    nested = tmp_path / "nested.jsonl"
    nested.write_text(json.dumps({"translation": {"de": "Haus", "en": "house"}}) + "\n")
    with pytest.raises(DataError, match=r"data.source: field 'en' not in the dataset \(fields: translation.de, "
                                        r"translation.en\); did you mean 'translation.en'\?"):
        load_pairs(DataConfig(data_files={"train": str(nested)}, source="en", target="de"), "train")
    with pytest.raises(DataError, match=r"data.target: field 'fr' not in the dataset \(fields: de, en\)"):
        load_pairs(DataConfig(data_files={"train": good}, source="de", target="fr"), "train")
    with pytest.raises(DataError, match="data file not found: .*missing.jsonl"):
        load_pairs(DataConfig(data_files={"train": str(tmp_path / "missing.jsonl")}), "train")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="is empty|could not read"):
        load_pairs(DataConfig(data_files={"train": str(empty)}), "train")
    hint = "offline, or a folder elsewhere\\? point at local data: train --set data.dataset=.*eval --data-files FILE"
    with pytest.raises(DataError, match="from the Hugging Face hub .*" + hint):
        load_pairs(DataConfig(dataset="nobody/no-such-dataset-here"), "train")
    with pytest.raises(DataError, match="data.dataset: no such folder '.*missing-folder'; check the path"):
        load_pairs(DataConfig(dataset=str(tmp_path / "missing-folder")), "train")


def test_subset_picks_one_configuration_of_a_dataset(tmp_path):
    folder = tmp_path / "multi"
    for subset, rows in (("de-en", ROWS[:2]), ("fr-en", [{"de": "maison", "en": "house"}])):
        (folder / subset).mkdir(parents=True)
        _jsonl(folder / subset / "train.jsonl", rows)
    (folder / "README.md").write_text(  # the dataset card's YAML header declares the subsets
        "---\nconfigs:\n" + "".join(f"- config_name: {name}\n  data_files:\n  - split: train\n"
                                    f"    path: {name}/train.jsonl\n" for name in ("de-en", "fr-en")) + "---\n")
    pick = DataConfig(dataset=str(folder), source="en", target="de")
    assert load_pairs(replace(pick, subset="fr-en"), "train") == [("house", "maison")]
    assert load_pairs(replace(pick, subset="de-en"), "train") == [(r["en"], r["de"]) for r in ROWS[:2]]
    with pytest.raises(DataError, match=r"data.subset: '.*multi' has several subsets \(de-en, fr-en\); pick one, "
                                        r"e.g. --set data.subset=de-en"):
        load_pairs(pick, "train")
    with pytest.raises(DataError, match=r"data.subset: '.*multi' has no subset 'cs-en' \(has: de-en, fr-en\)"):
        load_pairs(replace(pick, subset="cs-en"), "train")
    assert data_fingerprint(replace(pick, subset="de-en"), "train") != data_fingerprint(replace(pick, subset="fr-en"),
                                                                                      "train")


def _cache_as_hub_dataset(cache, repo_id, data_file):
    """Build ``data_file`` into the datasets cache laid out as a downloaded hub dataset's."""
    import shutil

    from datasets.packaged_modules.json.json import Json

    namespace, name = repo_id.split("/")
    builder = Json(data_files={"train": data_file}, cache_dir=str(cache / "build"), dataset_name=name)
    builder.download_and_prepare()
    shutil.copytree(builder.cache_dir, cache / f"{namespace}___{name}" / "default" / "0.0.0" / "0123abcd")


def test_an_unreachable_hub_loads_cached_datasets_at_once_and_fails_at_once_otherwise(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants
    import socket
    import time

    def no_dns(address, *args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    def no_retries(seconds):
        raise AssertionError("huggingface_hub retried the unreachable hub")

    monkeypatch.setattr(socket, "create_connection", no_dns)
    monkeypatch.setattr(time, "sleep", no_retries)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # the tests run in offline mode
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    _cache_as_hub_dataset(tmp_path / "hf", "someone/cached-pairs", _jsonl(tmp_path / "train.jsonl", ROWS[:3]))

    cached = DataConfig(dataset="someone/cached-pairs", source="en", target="de")
    assert load_pairs(cached, "train") == [(r["en"], r["de"]) for r in ROWS[:3]]
    pinned = replace(cached, revision="a" * 40)  # a run's config.yaml names the commit it read
    assert load_pairs(pinned, "train") == [(r["en"], r["de"]) for r in ROWS[:3]]
    with pytest.raises(DataError, match="'someone/missing': no such folder here .*, and from the Hugging Face "
                                        "hub: it is unreachable "
                                        r"\(no address for huggingface.co\) and the datasets cache has no copy"):
        load_pairs(DataConfig(dataset="someone/missing"), "train")
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == (False, False)

    def firewalled(address, *args, **kwargs):  # the name resolves, the connection does not go through
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", firewalled)
    with pytest.raises(DataError, match=r"it is unreachable \(cannot connect to huggingface.co:443, "
                                        r"ConnectionRefusedError\) and the datasets cache has no copy"):
        load_pairs(DataConfig(dataset="someone/missing"), "train")


def test_a_run_records_the_commit_of_the_hub_dataset_it_reads(tmp_path, monkeypatch):
    """data.revision (a branch, a tag, or none: the default branch) becomes the commit it is at when a
    run starts, in the run's config.yaml: its resume, its eval and the cache key read that version, not
    one pushed since. A commit, local data and a hub out of reach are left as they are."""
    from types import SimpleNamespace

    import datasets
    import huggingface_hub

    from tformer_cli import hub
    from tformer_cli.runs import prepare_run

    commits, asked = {None: "a" * 40, "v2": "b" * 40}, []

    def dataset_info(api, name, revision=None, **kwargs):
        asked.append((name, revision))
        if revision not in commits:
            raise OSError(f"404 Revision Not Found: Invalid rev id: {revision}")  # as huggingface_hub's, an OSError
        return SimpleNamespace(sha=commits[revision])

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(hub, "unreachable", lambda: None)
    config = tmp_path / "c.yaml"
    config.write_text("data: {dataset: someone/pairs, source: de, target: en}\n")
    assert prepare_run(config, None, [], tmp_path / "run")[0].data.revision == "a" * 40
    pinned, _ = prepare_run(config, None, ["data.revision=v2"], tmp_path / "run")
    assert pinned.data.revision == "b" * 40 and asked == [("someone/pairs", None), ("someone/pairs", "v2")]
    other = prepare_run(config, None, [], tmp_path / "run", main=False)[0]  # a process beside rank 0: it takes
    assert other.data.revision is None and len(asked) == 2  # rank 0's commit in Setup, not one of its own asking
    cfg = pinned.data
    assert pin_revision(replace(cfg, revision="c" * 40)).revision == "c" * 40 and len(asked) == 2  # nothing asked
    assert pin_revision(replace(cfg, revision="nope")).revision == "nope"  # loading it says what is wrong
    local = DataConfig(dataset=str(tmp_path))
    assert pin_revision(local) == local and len(asked) == 3
    monkeypatch.setattr(hub, "unreachable", lambda: "no address for huggingface.co")
    assert pin_revision(replace(cfg, revision=None)).revision is None
    assert data_fingerprint(cfg, "train") != data_fingerprint(replace(cfg, revision="a" * 40), "train")

    loaded = []

    def load_dataset(name, subset=None, revision=None, **kwargs):
        loaded.append((name, revision))
        if revision == "nope":  # as datasets words it
            raise datasets.exceptions.DatasetNotFoundError(f"Revision '{revision}' doesn't exist for dataset '{name}' "
                                                           "on the Hub.")
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2])})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert load_pairs(cfg, "train") == [(r["de"], r["en"]) for r in ROWS[:2]]
    assert loaded == [("someone/pairs", "b" * 40)]
    monkeypatch.setattr(hub, "unreachable", lambda: None)
    with pytest.raises(DataError, match="^data.revision: 'someone/pairs' has no revision 'nope' "
                                        r"\(Revision 'nope' doesn't exist .*\); name a branch, tag or commit of it$"):
        load_pairs(replace(cfg, revision="nope"), "train")
    _jsonl(tmp_path / "train.jsonl", ROWS[:2])
    with pytest.raises(DataError, match=f"^data.revision: selects a version of a hub dataset, and '{tmp_path}' is a "
                                        "local folder; remove data.revision$"):
        load_pairs(replace(local, revision="v2"), "train")

    # a resume reads the commit its run recorded; overrides that name other data drop it, for that data's own
    from tformer_cli.config import to_yaml
    from tformer_cli.run_folder import CONFIG, MARKER

    run = tmp_path / "run"
    run.mkdir()
    (run / MARKER).write_text("{}\n")
    (run / CONFIG).write_text(to_yaml(pinned))
    resumed = {tuple(o): prepare_run(None, run, o, None)[0].data.revision
               for o in (["train.max_steps=9"], ["data.dataset=someone/pairs"], ["data.dataset=someone/other"],
                         ["data.dataset=someone/other", "data.revision=v2"], [f"data.dataset={tmp_path}"],
                         [f"data.data_files.train={tmp_path / 'train.jsonl'}",
                          f"data.data_files.validation={tmp_path / 'train.jsonl'}"])}
    assert list(resumed.values()) == ["b" * 40, "b" * 40, "a" * 40, "b" * 40, None, None]
    assert asked[-2:] == [("someone/other", None), ("someone/other", "v2")]


def test_a_hub_that_connects_but_never_answers_leaves_the_revision_as_it_is(monkeypatch):
    """A proxy or mirror that takes the connection and says nothing: pinning the commit gives up after
    hub.ANSWER_TIMEOUT (huggingface_hub waits forever), and loading the dataset says what is wrong."""
    import socket

    import huggingface_hub.constants

    from tformer_cli import hub

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the tests' setting
        monkeypatch.setattr(hub, "unreachable", lambda: None)  # it connects
        monkeypatch.setattr(hub, "ANSWER_TIMEOUT", 0.5)
        assert hub.commit_of("someone/pairs", "main") is None


def test_encode_split_drops_empty_and_drops_or_truncates_long_pairs():
    vocab = Vocabulary.train([("a b c d e f g", "a b c d e f g")], vocab_size=40, min_frequency=1)
    pairs = [("a b", "c d"), ("", "c"), ("a b c d e f g a b c d e f g", "a")]
    dropped = encode_split(pairs, vocab, DataConfig(max_length=8))
    assert (len(dropped), dropped.dropped_empty, dropped.dropped_long) == (1, 1, 1)
    truncated = encode_split(pairs, vocab, DataConfig(max_length=8, long_pairs="truncate"))
    assert (len(truncated), truncated.truncated) == (2, 1)
    assert len(truncated.src[1]) == 8 and truncated.src[1][-1] == vocab.encode_sources(["a"])[0][-1]


def test_encode_split_gives_the_same_split_in_chunks_of_any_size():
    """BPE-dropout's draw encodes in smaller chunks than the cache does (encoding.DRAW_CHUNK): the
    chunks change nothing, the counts of dropped and truncated pairs included."""
    vocab = Vocabulary.train([("a b c d e f g", "a b c d e f g")], vocab_size=40, min_frequency=1)
    pairs = [("a b", "c d"), ("", "c"), ("a b c d e f g a b c d e f g", "a"), ("c", "")] * 5 + [("g f", "e")]
    for long_pairs in ("drop", "truncate"):
        cfg = DataConfig(max_length=8, long_pairs=long_pairs)
        whole = encode_split(pairs, vocab, cfg)
        for chunk in (1, 3, 7):
            assert encode_split(pairs, vocab, cfg, chunk) == whole


def test_bpe_learns_from_blocks_spread_over_the_whole_split_when_it_is_larger_than_bpe_max_pairs():
    from tformer_cli.tokenizer import _batches

    pairs = [(f"s{i}", f"t{i}") for i in range(100)]
    sampled = list(_batches(pairs, (0, 1), max_pairs=30, size=10))
    assert [batch[::2] for batch in sampled] == [[f"s{i}" for i in range(start, start + 10)] for start in (0, 45, 90)]
    assert sampled[0][:2] == ["s0", "t0"]  # both sides of a pair, together
    assert [t for batch in _batches(pairs, (1,), max_pairs=100, size=30) for t in batch] == [p[1] for p in pairs]
    # the vocabulary holds what the sample holds: a word only outside it is never merged
    rare = [("zebra zebra", "zebra zebra")] * 20
    vocab = Vocabulary.train([("a house", "ein Haus")] * 10_000 + rare, vocab_size=60, min_frequency=1,
                             max_pairs=10_000)
    assert "▁zebra" not in vocab.source.get_vocab()
    assert "▁zebra" in Vocabulary.train(rare, vocab_size=60, min_frequency=1).source.get_vocab()


def test_the_cache_is_in_home_unless_tformer_cache_names_a_folder(tmp_path, monkeypatch):
    from tformer_cli.encoding import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    for unset in ("", None):  # set but empty is unset, as shells mean it: not the current directory
        monkeypatch.delenv("TFORMER_CACHE") if unset is None else monkeypatch.setenv("TFORMER_CACHE", unset)
        assert cache_dir() == tmp_path / ".cache" / "tformer"


def test_encoded_splits_are_cached(tmp_path):
    path = _jsonl(tmp_path / "train.jsonl", ROWS)
    cfg = DataConfig(data_files={"train": path}, source="de", target="en")
    vocab = Vocabulary.train([(r["de"], r["en"]) for r in ROWS], vocab_size=60, min_frequency=1)
    first = load_encoded(cfg, "train", vocab)
    cached = load_encoded(cfg, "train", vocab)
    assert cached.src == first.src and cached.tgt == first.tgt and cached is not first
    # the cache entry's checksum is the split's signature, as a split tokenised afresh computes it
    afresh = encode_split(load_pairs(cfg, "train"), vocab, cfg)
    assert cached.checksum and cached.signature() == afresh.signature() and afresh.checksum is None
    assert list(cached.pairs) == [(r["de"], r["en"]) for r in ROWS] == list(first.pairs)
    _jsonl(tmp_path / "train.jsonl", ROWS[:4])  # changed data invalidates the cache
    assert len(load_encoded(cfg, "train", vocab)) == 4


def test_worker_processes_encode_a_split_as_one_process_does(tmp_path, monkeypatch):
    import tformer_cli.encoding as encoding

    rows = ROWS + [{"de": "", "en": "leer"}, {"de": "ein Haus " * 20, "en": "a house"}] + ROWS[:5]
    cfg = DataConfig(data_files={"train": _jsonl(tmp_path / "train.jsonl", rows)}, source="de", target="en",
                     max_length=16)
    vocab = Vocabulary.train([(r["de"], r["en"]) for r in ROWS], vocab_size=60, min_frequency=1)
    monkeypatch.setattr(encoding, "ENCODE_IN_WORKERS", 1)  # any split: workers
    monkeypatch.setattr(encoding, "usable_cpus", lambda: 3)  # three of them, so that the ranges are uneven
    parallel = load_encoded(cfg, "train", vocab)
    serial = encode_split(load_pairs(cfg, "train"), vocab, cfg)
    assert parallel.src == serial.src and parallel.tgt == serial.tgt and list(parallel.pairs) == list(serial.pairs)
    assert (parallel.dropped_empty, parallel.dropped_long) == (serial.dropped_empty, serial.dropped_long) == (1, 1)
    assert not list((encoding.cache_dir()).glob("encoding-*"))  # the workers' parts are gone


def test_a_child_process_fills_the_cache_with_what_this_process_would_have_made(tmp_path, monkeypatch):
    rows = ROWS + [{"de": "", "en": "leer"}]
    cfg = DataConfig(data_files={"train": _jsonl(tmp_path / "train.jsonl", rows),
                                 "validation": _jsonl(tmp_path / "valid.jsonl", ROWS[:3])},
                     source="de", target="en", vocab_size=60, min_frequency=1)
    assert cached_vocabulary(cfg) is None
    assert prepare_apart(cfg, ["train", "validation"]) == []
    vocab = cached_vocabulary(cfg)  # the child's
    assert vocab is not None and encodings_cached(cfg, ["train", "validation"], vocab)
    read = {split: load_encoded(cfg, split, vocab) for split in ("train", "validation")}
    shared = os.environ["TFORMER_CACHE"]
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "own"))  # this process's own, made here
    assert train_or_load_vocabulary(cfg).fingerprint() == vocab.fingerprint()
    for split, got in read.items():
        made = encode_split(load_pairs(cfg, split), vocab, cfg)
        assert got.src == made.src and got.tgt == made.tgt and list(got.pairs) == list(made.pairs)
        assert got.dropped_empty == made.dropped_empty
    monkeypatch.setenv("TFORMER_CACHE", shared)
    # with a vocabulary given (a run folder's), only the encodings are made
    folder = tmp_path / "run"
    folder.mkdir()
    vocab.save(folder)
    other = replace(cfg, max_length=4)
    assert not encodings_cached(other, ["train"], vocab)
    prepare_apart(other, ["train"], folder)
    assert encodings_cached(other, ["train"], vocab)


def test_the_child_process_errors_arrive_as_one_line_errors(tmp_path):
    from tformer_cli.preparing import _in_child

    missing = DataConfig(data_files={"train": str(tmp_path / "nowhere.jsonl")}, source="de", target="en")
    with pytest.raises(DataError) as raised:
        prepare_apart(missing, ["train"])
    with pytest.raises(DataError) as in_process:
        load_pairs(missing, "train")
    assert str(raised.value) == str(in_process.value)
    with pytest.raises(DataError, match=r"exit code 3 \(its error is above\)"):  # a child that dies without answering
        _in_child(os._exit, 3)
    with pytest.raises(DataError, match=r"exit code -6 \(SIGABRT: a library it ran crashed\)"):  # as tokenizers can
        _in_child(os.abort)


def test_a_signal_while_the_child_works_stops_it_at_once():
    import signal
    import time

    from tformer_cli.preparing import _in_child
    from tformer_cli.errors import Interrupted

    def interrupted(signum, frame):  # as training's set-up handles SIGINT and SIGTERM
        raise Interrupted(signum)

    before = signal.signal(signal.SIGALRM, interrupted)
    start = time.perf_counter()
    signal.alarm(3)
    try:
        with pytest.raises(Interrupted):
            _in_child(time.sleep, 120)  # returns once the child, stopped, has exited
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert time.perf_counter() - start < 30


def test_resegment_draws_a_new_segmentation_of_the_same_pairs_and_keeps_the_cache_key():
    pairs = [(r["de"] + " Gartenhaus", r["en"] + " greenhouse") for r in ROWS]
    vocab = Vocabulary.train(pairs, vocab_size=80, min_frequency=1)
    cfg = DataConfig(bpe_dropout=0.5)
    plain = encode_split(pairs, vocab, cfg)
    noisy = resegment(plain, vocab, cfg)
    assert noisy.pairs == plain.pairs and noisy.src != plain.src
    assert sum(map(len, noisy.tgt)) > sum(map(len, plain.tgt))
    assert data_fingerprint(cfg, "train") == data_fingerprint(DataConfig(), "train")  # same vocabulary and cache
    shares = [resegment(plain, vocab, cfg, (i, 3)) for i in range(3)]  # three processes' shares of a draw
    assert [len(share) for share in shares] == [len(plain) * (i + 1) // 3 - len(plain) * i // 3 for i in range(3)]
    assert joined(shares).pairs == plain.pairs and len(joined(shares).src) == len(plain)


def test_a_split_joined_from_parts_is_the_split_also_where_a_part_is_empty():
    """``joined`` of parts, also as ``split_from_tensors`` gives them back (an empty part's tensors hold a
    byte that stands for no text): the split those parts were cut from."""
    whole = EncodedSplit([[5, 2], [6, 7, 2], [8, 2]], [[1, 9, 2], [1, 2], [1, 3, 3, 2]],
                         [("a", "b"), ("cé", "d"), ("e", "f")], dropped_empty=1, dropped_long=2, truncated=1)
    parts = [EncodedSplit([], [], [], dropped_empty=1), EncodedSplit([[5, 2], [6, 7, 2]], [[1, 9, 2], [1, 2]],
                                                                      [("a", "b"), ("cé", "d")], dropped_long=2),
             EncodedSplit([], [], []), EncodedSplit([[8, 2]], [[1, 3, 3, 2]], [("e", "f")], truncated=1)]
    assert joined(parts) == whole and joined(parts).pairs.data.numel() == whole.pairs.data.numel()
    sent = [split_from_tensors(split_tensors(p), split_counts(p)) for p in parts]
    assert joined(sent) == whole and joined(sent).pairs.data.numel() == whole.pairs.data.numel()
    assert list(joined(sent).pairs) == list(whole.pairs)


def test_token_batches_respect_max_tokens_and_cover_every_example_once():
    import random

    rng = random.Random(0)
    src = [rng.randint(1, 40) for _ in range(500)]
    tgt = [rng.randint(1, 40) for _ in range(500)]
    batches = token_batches(src, tgt, max_tokens=200, seed=1, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(500))
    for batch in batches:
        assert len(batch) * max(max(src[i], tgt[i]) for i in batch) <= 200
    assert token_batches(src, tgt, 200, seed=1, epoch=0) == batches
    assert token_batches(torch.tensor(src), torch.tensor(tgt), 200, seed=1, epoch=0) == batches  # Sequences' kind
    assert token_batches(src, tgt, 200, seed=1, epoch=1) != batches
    # shuffled, each batch still spans its own stretch of the length order: ties broken, lengths never crossed
    spans = sorted([max(src[i], tgt[i]) for i in batch] for batch in batches)
    assert sum(spans, []) == sorted(sum(spans, []))
    # unshuffled, batches come in length order, and each is full: the next example would overflow it
    ordered = token_batches(src, tgt, 200, shuffle=False)
    longest = [[max(src[i], tgt[i]) for i in batch] for batch in ordered]
    assert sum(longest, []) == sorted(sum(longest, []))
    for batch, following in zip(longest, longest[1:]):
        assert following[0] * (len(batch) + 1) > 200
    assert token_batches([300, 2], [1, 2], 200, shuffle=False) == [[1], [0]]  # too long alone: a batch of one
    for world in (2, 3, 7):  # every process gets as many batches; the epoch's last len % world wait
        shards = [token_batches(src, tgt, 200, seed=1, epoch=0, rank=r, world_size=world) for r in range(world)]
        assert len({len(shard) for shard in shards}) == 1
        assert sorted(b for shard in shards for b in shard) == sorted(batches[:len(batches) // world * world])


def test_steps_shared_out_give_every_process_its_batches_of_the_same_steps():
    from tformer_cli.batching import shared_out

    steps = [list(range(10 * i, 10 * i + n)) for i, n in enumerate([8, 9, 3, 1, 6])]
    for processes, accumulation in [(1, 1), (1, 3), (2, 1), (2, 2), (3, 2)]:
        parts = processes * accumulation
        shares = [shared_out(steps, processes, accumulation, rank) for rank in range(processes)]
        kept = [step for step in steps if len(step) >= parts]  # a step too small for a batch each: left out
        assert all(len(share) == len(kept) * accumulation for share in shares)
        for s, step in enumerate(kept):  # each step's examples, each once, among its batches
            batches = [batch for share in shares for batch in share[s * accumulation:(s + 1) * accumulation]]
            assert sorted(sum(batches, [])) == step and all(batches)
            assert max(map(len, batches)) - min(map(len, batches)) <= 1  # dealt: alike in size
    assert shared_out(steps, 2, 1, 0)[0] == [0, 2, 4, 6] and shared_out(steps, 2, 1, 1)[0] == [1, 3, 5, 7]


def test_token_batches_hold_a_multiple_of_sentences_wherever_that_many_fit():
    import random

    rng = random.Random(1)
    src = [rng.randint(1, 60) for _ in range(700)]
    tgt = [rng.randint(1, 60) for _ in range(700)]
    ordered = token_batches(src, tgt, 300, shuffle=False, multiple=8)
    assert sorted(i for b in ordered for i in b) == list(range(700))
    sizes = set()
    for batch, following in zip(ordered, ordered[1:]):
        longest = max(max(src[i], tgt[i]) for i in batch)
        assert len(batch) * longest <= 300
        if len(batch) % 8:  # fewer than 8 fit: the batch is as full as without the rule
            assert len(batch) < 8 and max(src[following[0]], tgt[following[0]]) * (len(batch) + 1) > 300
        sizes.add(len(batch))
    assert {8, 16}.issubset(sizes) and sizes & set(range(1, 8))  # both kinds occur in this draw
    shuffled = token_batches(src, tgt, 300, seed=3, multiple=8)  # the epoch's last batch holds what is left
    assert all(len(batch) % 8 == 0 or len(batch) < 8 for batch in shuffled)


def test_collate_pads_and_shifts_targets():
    from tformer_cli.encoding import EncodedSplit

    split = EncodedSplit(src=[[5, 6, 2], [7, 2]], tgt=[[1, 8, 9, 2], [1, 8, 2]], pairs=[("", "")] * 2)
    batch = collate(split, [0, 1])
    assert batch.src.tolist() == [[5, 6, 2], [7, 2, PAD_ID]]
    assert batch.tgt_in.tolist() == [[1, 8, 9], [1, 8, 2]]
    assert batch.tgt_out.tolist() == [[8, 9, 2], [8, 2, PAD_ID]]
    assert batch.num_tokens == 5

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import typer
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import write_config
from tformer_cli.cli import app
from tformer_cli.config import load_config
from tformer_cli.errors import UsageError
from tformer_cli.files import read_jsonl
from tformer_cli.run_folder import find_weights, step_checkpoints
from tformer_cli.runtime import choose_checkpoints
from tformer_cli.train import train

runner = CliRunner()


@pytest.fixture
def run_dir(trained_run):
    return trained_run


COMMANDS = sorted(typer.main.get_command(app).commands)


def test_help_lists_every_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert COMMANDS == ["average", "count-params", "eval", "export", "generate", "inspect-attention", "plot", "train"]
    for command in COMMANDS:
        assert command in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples_that_use_its_own_options(command):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and "Examples:" in result.output
    text, panels = result.output.split("╭", 1)  # the docstring with its examples; the option panels
    examples = [line.strip().split("  ")[0] for line in text.split("Examples:")[1].splitlines()
                if line.strip().startswith(("tformer ", "torchrun "))]
    own = [e.split(f" {command} ", 1)[1] for e in examples if f"tformer {command} " in e or f"tformer_cli {command} " in e]
    assert own, result.output  # (an example may show the next command, as average's shows eval)
    for example in own:
        for option in re.findall(r"(?:^|\s)(--[a-z][a-z-]*)", example):
            assert option in panels, (command, option)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_options_help_shows_its_brackets(command):
    """Help is Rich markup: a bracket that is text, as in pip install 'tformer[ctranslate2]', must be
    escaped, or Rich takes it for a style and drops it."""
    from rich.text import Text

    for param in typer.main.get_command(app).commands[command].params:
        shown = Text.from_markup(getattr(param, "help", None) or "").plain
        assert shown.count("[") == shown.count("]") == (param.help or "").count("]"), (command, param.name, shown)


def test_paths_and_texts_with_brackets_are_printed_as_they_are(run_dir, tmp_path):
    """Rich reads [word] as a style and [/] as its end: a run folder, a file or a sentence that holds
    them is shown verbatim, never restyled, cut or a traceback."""
    run = tmp_path / "sweep[red]" / "lr[bold]"
    shutil.copytree(run_dir, run)

    def shows(expected: str, *args: str) -> bool:  # white space aside: a table's title wraps long paths
        result = runner.invoke(app, [*args], env={"COLUMNS": "400", "NO_COLOR": "1"})
        assert result.exit_code == 0, result.output
        return "".join(expected.split()) in "".join(result.output.split())

    assert shows(f"{run} · test · beam 1", "eval", str(run), "--max-samples", "2", "--beam", "1")
    assert shows(f"-> {tmp_path / 'avg[x]'}", "average", str(run), "--last", "2", "--output", str(tmp_path / "avg[x]"))
    assert shows(f"saved {tmp_path / 'c[i].png'}", "plot", str(run), "--output", str(tmp_path / "c[i].png"))
    assert shows(f"-> {tmp_path / 'e[b]'}", "export", str(run), str(tmp_path / "e[b]"))
    assert shows("source seven [/] [dim]one", "inspect-attention", str(run), "seven [/] [dim]one")
    assert shows(f"saved {tmp_path / 'a[b].png'}", "inspect-attention", str(run), "seven", "--save",
                 str(tmp_path / "a[b].png"))
    assert shows(f"training {run} on cpu, resumed at step 30", "train", "--resume", str(run), "--set",
                 "train.max_steps=31")


def test_a_long_run_path_stays_on_one_line_to_copy(run_dir, tmp_path):
    """Rich folds a line to the terminal's width (80 columns in a pipe or a log), and a table's title to
    the table's: a long path came out in pieces. Printed lines are whole, and the headings of eval's
    and train's tables are lines of their own."""
    run = tmp_path / ("x" * 70) / "run"
    shutil.copytree(run_dir, run)
    for args, shown in ((["eval", str(run), "--max-samples", "2", "--beam", "1"], run),
                        (["train", "--resume", str(run), "--set", "train.max_steps=31"], run),
                        (["plot", str(run), "--output", str(run / "curves.png")], run / "curves.png"),
                        (["average", str(run), "--last", "2"], run / "checkpoints" / "average-last-2")):
        result = runner.invoke(app, args, env={"COLUMNS": "80"})
        assert result.exit_code == 0 and str(shown) in result.output, result.output


def test_images_show_paths_and_tokens_with_dollar_signs_as_text(run_dir, tmp_path, monkeypatch):
    """matplotlib typesets $...$ as mathematics: a run folder or a sentence holding a pair of them must
    be drawn as written, not typeset, nor (with a backslash) fail to typeset."""
    import tformer_cli.render_attention as render_attention
    import tformer_cli.render_curves as render_curves

    texts = []  # what the images hold that came from the user: the curves' title, the maps' tokens and titles

    def keeping(write, user_texts):
        def keep(figure, path, dpi):
            texts.extend(user_texts(figure))
            write(figure, path, dpi)
        return keep

    monkeypatch.setattr(render_curves, "write_figure", keeping(render_curves.write_figure, lambda figure: figure.texts))
    monkeypatch.setattr(render_attention, "write_figure", keeping(
        render_attention.write_figure,
        lambda figure: [t for ax in figure.axes if ax.get_label() != "<colorbar>"
                        for t in (*ax.get_xticklabels(), *ax.get_yticklabels(), ax.title)]))
    run = tmp_path / "run$\\foo$"
    shutil.copytree(run_dir, run)
    plotted = runner.invoke(app, ["plot", str(run), "--output", str(tmp_path / "curves.png")])
    assert plotted.exit_code == 0, plotted.output
    saved = runner.invoke(app, ["inspect-attention", str(run), "seven $\\foo$ $x^$", "--save", str(tmp_path / "a.png")])
    assert saved.exit_code == 0, saved.output
    assert texts[0].get_text() == str(run) and len(texts) > 5
    assert not any(t.get_parse_math() for t in texts)


def test_train_json_summary_and_resume_refusal(run_dir, tmp_path):
    result = runner.invoke(app, ["train", "--resume", str(run_dir), "--set", "train.max_steps=31", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["step"] == 31 and summary["stop_reason"] == "reached train.max_steps 31"
    # what the closing table shows, and how it trained, as the run's own files have it
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validations = [r for r in records if r["split"] == "validation"]
    assert summary["last_eval"]["loss"] == validations[-1]["loss"] and summary["last_eval"]["step"] == 31
    assert summary["best_step"] == [r["step"] for r in validations if r["best"]][-1]
    assert summary["target_tokens"] > 0 and summary["epoch"] >= 0
    assert summary["tokens_per_s"] == pytest.approx(summary["target_tokens"] / summary["elapsed"])
    weights = load_file(str(run_dir / "model.safetensors"))
    assert summary["parameters"] == sum(w.numel() for w in weights.values())
    assert (summary["device"], summary["processes"], summary["precision"], summary["compiled"]) == ("cpu", 1, "fp32", False)
    again = runner.invoke(app, ["train", str(run_dir / "config.yaml"), "--output-dir", str(run_dir)])
    assert again.exit_code == 1 and "already holds a run" in again.output


def test_eval_reports_scores_and_writes_hypotheses(run_dir, tmp_path):
    out = tmp_path / "hyps.txt"
    result = runner.invoke(app, ["eval", str(run_dir), "--split", "validation", "--max-samples", "12", "--beam", "2",
                                 "--output", str(out), "--json"])
    assert result.exit_code == 0, result.output
    scores = json.loads(result.stdout)
    assert scores["sentences"] == 12 and scores["beam_size"] == 2
    assert {"bleu", "bleu_lowercase", "chrf", "exact_match", "loss", "perplexity", "sentences_per_s"} <= set(scores)
    assert len(out.read_text().splitlines()) == 12
    table = runner.invoke(app, ["eval", str(run_dir), "--max-samples", "5", "--beam", "1"])
    assert table.exit_code == 0 and "BLEU" in table.output and "sacreBLEU nrefs:1" in table.output


def test_eval_and_generate_decode_in_batches_of_max_tokens(run_dir, monkeypatch):
    import tformer_cli.decoding as decoding

    args = ["eval", str(run_dir), "--split", "validation", "--max-samples", "12", "--beam", "2", "--json"]
    plain = json.loads(runner.invoke(app, args).stdout)
    rows, decode = [], decoding.decode_batch
    monkeypatch.setattr(decoding, "decode_batch", lambda *a: rows.append(a[1].shape) or decode(*a))
    budgeted = json.loads(runner.invoke(app, args + ["--max-tokens", "40"]).stdout)
    assert len(rows) > 1 and all(n * 2 * length <= 40 or n == 1 for n, length in rows)
    assert budgeted["bleu"] == plain["bleu"] and budgeted["loss"] == plain["loss"]
    texts = ["seven", "three hundred twelve", "eight", "forty-one"]
    alone = runner.invoke(app, ["generate", str(run_dir), *texts, "--batch-size", "1"])
    rows.clear()
    budgeted = runner.invoke(app, ["generate", str(run_dir), *texts, "--max-tokens", "24"])
    assert budgeted.exit_code == 0 and budgeted.stdout == alone.stdout and len(rows) > 1
    for command in (["eval", str(run_dir)], ["generate", str(run_dir), "seven"]):
        bad = runner.invoke(app, command + ["--max-tokens", "0"])
        assert bad.exit_code == 1 and bad.output.strip() == "error: --max-tokens 0: must be >= 1", bad.output


def test_eval_and_generate_under_bf16_autocast(run_dir):
    args = ["eval", str(run_dir), "--split", "validation", "--max-samples", "16", "--beam", "1", "--json"]
    fp32 = json.loads(runner.invoke(app, args).stdout)
    result = runner.invoke(app, args + ["--precision", "bf16"])
    assert result.exit_code == 0, result.output
    bf16 = json.loads(result.stdout)
    assert fp32["precision"] == "fp32"  # the default, auto, on a CPU
    assert bf16["precision"] == "bf16" and bf16["sentences"] == 16
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.05, abs=0.02)
    table = runner.invoke(app, args[:-1] + ["--precision", "bf16"])
    assert table.exit_code == 0 and " · validation · beam 1 · bf16\n" in table.stdout
    generated = runner.invoke(app, ["generate", str(run_dir), "seven", "twelve", "--precision", "bf16"])
    assert generated.exit_code == 0 and len(generated.stdout.splitlines()) == 2
    bad = runner.invoke(app, ["eval", str(run_dir), "--precision", "int4"])
    assert bad.exit_code == 1 and "use auto, fp32, bf16 or fp16" in bad.output and "Traceback" not in bad.output


def test_decoding_in_bf16_warns_on_a_cpu_without_native_bf16(run_dir, monkeypatch):
    monkeypatch.setattr("tformer_cli.accel.ops.native_on_cpu", lambda precision: False)
    result = runner.invoke(app, ["generate", str(run_dir), "seven", "--precision", "bf16", "--device", "cpu"])
    assert result.exit_code == 0 and len(result.stdout.splitlines()) == 1
    assert "no native bf16" in result.stderr and "--precision fp32" in result.stderr


def test_eval_on_other_files(run_dir, tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text('{"number": "seven", "zahl": "sieben"}\n{"number": "ten", "zahl": "zehn"}\n')
    result = runner.invoke(app, ["eval", str(run_dir), "--data-files", str(data), "--source-field", "number",
                                 "--target-field", "zahl", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sentences"] == 2 and json.loads(result.stdout)["empty_references"] == 0
    data.write_text('{"number": "seven", "zahl": "sieben"}\n{"number": "ten", "zahl": " "}\n')
    one_empty = runner.invoke(app, ["eval", str(run_dir), "--data-files", str(data), "--source-field", "number",
                                    "--target-field", "zahl", "--json"])
    assert one_empty.exit_code == 0 and json.loads(one_empty.stdout)["empty_references"] == 1
    assert "warning: 1 of 2 references are empty" in one_empty.stderr
    missing = runner.invoke(app, ["eval", str(run_dir), "--data-files", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 1 and missing.output == f"error: --data-files {tmp_path / 'nope.jsonl'}: no such file\n"


def test_eval_data_files_may_be_glob_patterns(run_dir, tmp_path):
    """A quoted pattern is read as training reads one: the files it matches, sorted."""
    shards = tmp_path / "shards"
    shards.mkdir()
    pairs = [("seven", "sieben"), ("ten", "zehn"), ("three", "drei")]
    for i, (en, de) in enumerate(pairs):
        (shards / f"test-{i}.jsonl").write_text(json.dumps({"number": en, "zahl": de}) + "\n")
    (shards / "test-x.jsonl").mkdir()  # a folder that matches is skipped
    fields = ["--source-field", "number", "--target-field", "zahl"]
    hyps = tmp_path / "hyps.txt"
    result = runner.invoke(app, ["eval", str(run_dir), "--data-files", str(shards / "test-*.jsonl"), *fields,
                                 "--beam", "1", "--output", str(hyps), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sentences"] == 3
    one_by_one = runner.invoke(app, ["generate", str(run_dir), "--beam", "1", *[en for en, _ in pairs]])
    assert hyps.read_text().splitlines() == one_by_one.stdout.splitlines()  # in the shards' sorted order
    none = runner.invoke(app, ["eval", str(run_dir), "--data-files", str(tmp_path / "nope-*.jsonl")])
    assert none.exit_code == 1 and none.output == f"error: --data-files {tmp_path / 'nope-*.jsonl'}: no file matches the pattern\n"
    (tmp_path / "s.en").write_text("seven\n")
    (tmp_path / "s.de").write_text("sieben\n")
    text = runner.invoke(app, ["eval", str(run_dir), "--data-files", str(tmp_path / "s.*")])
    assert text.exit_code == 1 and "error: --data-files: " in text.output and "matches plain-text files" in text.output


def test_generate_from_arguments_and_stdin_one_line_per_input(run_dir):
    args = runner.invoke(app, ["generate", str(run_dir), "seven", "twenty-one"])
    assert args.exit_code == 0, args.output
    assert len(args.stdout.splitlines()) == 2
    lines = "seven\n\nthree hundred\n" + "nine " * 200 + "\nüñíçødé ☃\n"
    piped = runner.invoke(app, ["generate", str(run_dir), "--beam", "2"], input=lines)
    assert piped.exit_code == 0, piped.output
    outputs = piped.stdout.splitlines()
    assert len(outputs) == 5 and outputs[1] == ""
    assert "truncated" in piped.stderr
    marked = runner.invoke(app, ["generate", str(run_dir), "--beam", "2"], input=b"\xef\xbb\xbf" + lines.encode())
    assert marked.exit_code == 0 and marked.stdout == piped.stdout  # a byte-order mark is not part of line 1
    marked = runner.invoke(app, ["generate", str(run_dir), "--json-input"], input=b'\xef\xbb\xbf{"input": "seven"}\n')
    assert marked.exit_code == 0 and marked.stdout == args.stdout.splitlines()[0] + "\n"


def test_generate_translates_the_lines_that_have_arrived_in_one_batch(run_dir, monkeypatch):
    import tformer_cli.decoding as decoding

    batches = []
    translate = decoding.translate
    monkeypatch.setattr(decoding, "translate", lambda model, vocab, texts, *rest: batches.append(len(texts))
                        or translate(model, vocab, texts, *rest))
    piped = runner.invoke(app, ["generate", str(run_dir), "--batch-size", "2"], input="seven\neight\nnine\n")
    assert piped.exit_code == 0 and len(piped.stdout.splitlines()) == 3 and batches == [2, 1]


def test_input_lines_come_in_batches_of_what_has_arrived(tmp_path):
    """A pipe's lines are batched up to what it holds, so that a line sent alone is answered before
    the next is written; a file's are batched by size alone."""
    from tformer_cli.generate_input import InputLines, chunks

    read, write = os.pipe()
    with open(read, "rb", buffering=0) as stream:
        lines = InputLines(stream)
        batches = chunks(lines, 64, lines.waiting)
        os.write(write, "\ufeffseven\r\neight\nni".encode())
        os.write(write, b"ne\n")
        assert next(batches) == ["seven", "eight", "nine"]  # the rest of the pipe has yet to come
        os.write(write, b"ten\n")
        assert next(batches) == ["ten"]
        os.write(write, b"eleven\ntwelve")  # the last line without its end
        os.close(write)
        assert list(batches) == [["eleven", "twelve"]]
    text = tmp_path / "lines.txt"
    text.write_bytes(b"a\nb\nc\n\xff\n")
    with open(text, "rb") as stream:
        lines = InputLines(stream)
        batches = chunks(lines, 2, lines.waiting)
        assert next(batches) == ["a", "b"]
        assert next(batches) == ["c"]  # the lines before a bad one, then the error naming it
        with pytest.raises(UsageError, match="standard input, line 4: not UTF-8 text"):
            next(batches)


def test_generate_translates_the_lines_before_one_it_cannot_read(trained_run):
    """A bad line stops generate with one line naming it, after a translation of each line before it
    (in the same batch too), so that the output's lines match the input's up to it."""
    result = runner.invoke(app, ["generate", str(trained_run)], input=b"seven\n\neight\nn\xffne\nten\n")
    assert result.exit_code == 1 and result.stderr.strip() == (
        "error: standard input, line 4: not UTF-8 text (byte 2); convert it first, e.g. iconv -t UTF-8")
    assert result.stdout.splitlines() == runner.invoke(app, ["generate", str(trained_run), "seven", "", "eight"]
                                                       ).stdout.splitlines()


def test_generate_answers_a_program_line_by_line_over_a_pipe(trained_run):
    """A program that writes a line and waits for its translation (a pipe held open) gets it."""
    import select

    process = subprocess.Popen([sys.executable, "-m", "tformer_cli", "generate", str(trained_run)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        answers = []
        for line in (b"seven\n", b"eight\n"):
            process.stdin.write(line)
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], 60)
            assert ready, "no answer while the input stays open"
            answers.append(process.stdout.readline().decode().rstrip("\n"))
        process.stdin.close()
        assert process.wait(60) == 0 and process.stdout.read() == b""
    finally:
        process.kill()
    expected = runner.invoke(app, ["generate", str(trained_run), "seven", "eight"]).stdout.splitlines()
    assert answers == expected


def test_generate_refuses_beam_search_with_sampling(run_dir):
    result = runner.invoke(app, ["generate", str(run_dir), "seven", "--sample", "--beam", "3"])
    assert result.exit_code == 1 and result.output.startswith("error: --beam-size 3 with --sample: ")


def test_generate_json_sampling_and_nbest(run_dir):
    result = runner.invoke(app, ["generate", str(run_dir), "seven", "--json", "--nbest", "3"])
    record = json.loads(result.stdout)
    assert record["input"] == "seven" and len(record["outputs"]) == 3 and len(record["scores"]) == 3
    sample = ["generate", str(run_dir), "seven", "eight", "--sample", "--temperature", "1.5", "--seed", "4", "--json"]
    first, second = runner.invoke(app, sample), runner.invoke(app, sample)
    assert first.exit_code == 0 and first.stdout == second.stdout


def test_missing_run_folder_is_a_one_line_error(tmp_path):
    for command in (["eval", str(tmp_path / "nope")], ["generate", str(tmp_path / "nope"), "x"],
                    ["train", "--resume", str(tmp_path)]):
        result = runner.invoke(app, command)
        assert result.exit_code == 1, command
        assert result.output.count("\n") == 1 and result.output.startswith("error: "), result.output


def test_out_of_range_decoding_flags_are_one_line_errors_naming_the_flag(run_dir):
    alpha_range = "must be in [0, 10] (0: no length normalisation; 0.6 to 1 usual)"
    for flags, message in ((["--beam", "0"], "--beam-size 0: must be >= 1"),
                           (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
                           (["--sample", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
                           (["--sample", "--temperature", "-1"], "--temperature -1.0: must be >= 0 and finite"),
                           (["--sample", "--temperature", "inf"], "--temperature inf: must be >= 0 and finite"),
                           (["--length-penalty", "-0.5"], f"--length-penalty -0.5: {alpha_range}"),
                           (["--length-penalty", "inf"], f"--length-penalty inf: {alpha_range}"),
                           (["--length-penalty", "1000"], f"--length-penalty 1000.0: {alpha_range}"),  # overflowed
                           (["--nbest", str(2 ** 64)], f"--nbest {2 ** 64}: must be below 2^63"),  # past torch's int64
                           (["--max-new-tokens", str(2 ** 63)], f"--max-new-tokens {2 ** 63}: must be below 2^63"),
                           (["--sample", "--seed", "-1"], "--seed -1: must be in [0, 2^32)")):
        result = runner.invoke(app, ["generate", str(run_dir), "seven", *flags])
        assert result.exit_code == 1, flags
        assert result.output == f"error: {message}\n"
    result = runner.invoke(app, ["eval", str(run_dir), "--beam", "-2"])
    assert result.exit_code == 1 and result.output == "error: --beam-size -2: must be >= 1\n"


def test_eval_output_makes_its_folder_and_an_unwritable_path_is_a_one_line_error(run_dir, tmp_path):
    hyps = tmp_path / "new" / "folder" / "hyps.txt"
    result = runner.invoke(app, ["eval", str(run_dir), "--max-samples", "3", "--beam", "1", "--output", str(hyps)])
    assert result.exit_code == 0, result.output
    assert len(hyps.read_text().splitlines()) == 3
    result = runner.invoke(app, ["eval", str(run_dir), "--max-samples", "3", "--output", str(tmp_path)])
    assert result.exit_code == 1 and result.output == (f"error: --output {tmp_path}: is a folder; name a file for the "
                                                       f"hypotheses, e.g. {tmp_path / 'hyps.txt'}\n")


def test_eval_output_into_a_stream_is_written_as_it_comes(run_dir, tmp_path):
    """/dev/stdout, a shell's >(...) (/dev/fd/N) and a named pipe are written, never replaced: stdout
    redirected to a file with >> keeps what the file held, and a pipe's reader sees one stream."""
    import threading

    from tformer_cli.files import is_stream

    assert is_stream("/dev/stdout") and is_stream("/dev/fd/1") and is_stream("/dev/null")
    assert not is_stream(tmp_path / "hyps.txt") and not is_stream("/dev/shm/hyps.txt")  # files, replaced whole

    args = ["eval", str(run_dir), "--max-samples", "2", "--beam-size", "1", "--json", "--output"]
    log = tmp_path / "log.txt"  # the process's own stdout: a subprocess
    log.write_text("kept\n")
    with open(log, "a") as appended:
        done = subprocess.run([sys.executable, "-m", "tformer_cli", *args, "/dev/stdout"], stdout=appended, timeout=120)
    lines = log.read_text().splitlines()
    assert done.returncode == 0 and lines[0] == "kept" and len(lines) == 4, lines
    assert json.loads(lines[3])["sentences"] == 2
    hypotheses = lines[1:3]

    read, write = os.pipe()  # what bash's >(...) hands a command: /dev/fd/N
    done = runner.invoke(app, [*args, f"/dev/fd/{write}"])
    os.close(write)
    with os.fdopen(read) as piped:
        assert done.exit_code == 0 and piped.read().splitlines() == hypotheses, done.output

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.extend(fifo.read_text().splitlines()), daemon=True)
    reader.start()
    assert runner.invoke(app, [*args, str(fifo)]).exit_code == 0
    reader.join(timeout=60)
    assert received == hypotheses


def test_eval_output_to_a_descriptor_that_is_not_open_fails_before_decoding(run_dir, monkeypatch):
    """/dev/fd/N of a descriptor the shell did not open is no stream to write: a file that cannot be
    created, refused at once rather than after the whole evaluation."""
    import tformer_cli.decoding as decoding

    closed = next(fd for fd in range(900, 1000) if not os.path.exists(f"/dev/fd/{fd}"))
    monkeypatch.setattr(decoding, "translate", lambda *args, **kwargs: pytest.fail("decoded"))
    result = runner.invoke(app, ["eval", str(run_dir), "--max-samples", "2", "--output", f"/dev/fd/{closed}"])
    assert result.exit_code == 1 and result.output.strip() == (f"error: /dev/fd/{closed}: no such open descriptor (the "
                                                               "shell opens one for >(...) or N>); pick another path")


def test_eval_output_never_replaces_a_runs_files_or_the_data_it_reads(run_dir, tmp_path):
    run, dataset = tmp_path / "run", tmp_path / "numbers"  # copies: were a check to fail, nothing shared is lost
    shutil.copytree(run_dir, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    shutil.copytree(config["data"]["dataset"], dataset)
    config["data"]["dataset"] = str(dataset)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    source, target = tmp_path / "test.en", tmp_path / "test.de"  # a parallel text pair, named by language
    source.write_text("seven\ntwelve\n"), target.write_text("sieben\nzwölf\n")
    step = sorted((run / "checkpoints").iterdir())[0]
    own = [run / "model.safetensors", run / "config.yaml", run / "tokenizer.json", run / "metrics.jsonl",
           step / "model.safetensors", step / "trainer.pt"]
    from_files = ["--data-files", str(source), "--data-files", str(target)]
    refused = [([], path, "is one of a run's own files") for path in own] + [
        ([], dataset / "test.jsonl", "lies in the data being evaluated"),
        ([], dataset / "hyps.txt", "lies in the data being evaluated"),  # a local dataset would read it as data
        (from_files, target, "is the data being evaluated")]
    before = {path: path.read_bytes() for _, path, _ in refused if path.exists()}
    for flags, output, message in refused:
        result = runner.invoke(app, ["eval", str(run), "--max-samples", "2", *flags, "--output", str(output)])
        assert result.exit_code == 1 and result.output.count("\n") == 1 and message in result.output, result.output
    assert {path: path.read_bytes() for path in before} == before and not (dataset / "hyps.txt").exists()
    result = runner.invoke(app, ["eval", str(run), *from_files, "--output", str(tmp_path / "hyps.txt")])
    assert result.exit_code == 0 and len((tmp_path / "hyps.txt").read_text().splitlines()) == 2, result.output


def test_resume_refuses_to_change_the_model_or_vocabulary_and_leaves_the_run_as_it_was(run_dir):
    before = (run_dir / "config.yaml").read_text()
    for override in ("model.d_model=8", "model.num_encoder_layers=5", "data.vocab_size=999"):
        result = runner.invoke(app, ["train", "--resume", str(run_dir), "--set", override])
        assert result.exit_code == 1, override
        assert result.output.startswith(f"error: --set {override}: a resumed run keeps its ")
        assert result.output.count("\n") == 1
    assert (run_dir / "config.yaml").read_text() == before


def test_weights_that_do_not_fit_the_config_are_a_one_line_error(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    config = yaml.safe_load((copy / "config.yaml").read_text())
    config["model"]["d_model"] *= 2
    config["model"]["d_ff"] *= 2
    (copy / "config.yaml").write_text(yaml.safe_dump(config))
    result = runner.invoke(app, ["generate", str(copy), "seven"])
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert "weights do not fit the model in config.yaml" in result.output and "differ in shape" in result.output


def test_eval_output_is_not_created_when_the_run_fails_to_load(tmp_path):
    hyps = tmp_path / "out" / "hyps.txt"
    result = runner.invoke(app, ["eval", str(tmp_path / "no-run"), "--output", str(hyps)])
    assert result.exit_code == 1 and "no such run folder" in result.output
    assert not hyps.exists()


def test_running_out_of_memory_names_the_setting_to_lower(run_dir, tmp_path, monkeypatch):
    import torch

    import tformer_cli.decoding as decoding
    import tformer_cli.train as training
    from conftest import write_config

    def gpu_full(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def cpu_full(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(training, "train", gpu_full)
    monkeypatch.setattr(decoding, "translate", cpu_full)
    config = write_config(tmp_path / "m.yaml")
    decoding_line = ("error: out of CPU memory: lower --batch-size or --max-tokens (what is decoded together), or "
                     "--beam-size or --nbest (hypotheses a sentence)")
    for command, line in ((["train", str(config), "--output-dir", str(tmp_path / "run")],
                           "error: out of GPU memory: lower train.max_tokens (with train.step_tokens a step keeps "
                           "its tokens, in more batches; without, raise train.grad_accum to keep them); a run with "
                           "checkpoints goes on with tformer train --resume RUN --set train.max_tokens=..."),
                          (["generate", str(run_dir), "seven"], decoding_line)):
        result = runner.invoke(app, command)
        assert result.exit_code == 1 and result.output.strip() == line, result.output
    monkeypatch.undo()  # a request past the sizes torch can count: torch says its size overflowed
    result = runner.invoke(app, ["generate", str(run_dir), "seven", "--beam", str(2 ** 63 - 1)])
    assert result.exit_code == 1 and result.output.strip() == decoding_line, result.output
    monkeypatch.setattr(decoding, "translate", lambda *args: 1 / 0)  # other errors are not hidden
    assert isinstance(runner.invoke(app, ["generate", str(run_dir), "seven"]).exception, ZeroDivisionError)
    monkeypatch.undo()  # a model too large to build: no batch size helps

    import tformer_cli.run_setup as run_setup
    from tformer_cli.config import load_config
    from tformer_cli.model import build_model
    from tformer_cli.params import table_bytes
    from tformer_cli.render import human_bytes

    monkeypatch.setattr(run_setup, "build_model", cpu_full)
    result = runner.invoke(app, ["train", str(config), "--output-dir", str(tmp_path / "large")])
    assert result.exit_code == 1 and result.output.startswith("error: the model does not fit in the CPU's memory: "
                                                              "lower model.d_model"), result.output
    # a training state past the machine's memory: refused before the model is built, which the OS would
    # let fill the memory and then kill without a word
    monkeypatch.setattr(run_setup, "build_model", lambda *args: pytest.fail("the model was built"))
    monkeypatch.setattr(run_setup, "memory_bytes", lambda device: 2 ** 10)
    result = runner.invoke(app, ["train", str(config), "--output-dir", str(tmp_path / "larger")])
    assert result.exit_code == 1
    assert re.fullmatch(r"error: the model does not fit in the CPU's memory \(training its ([\d,]+) parameters "
                        r"needs at least (.*) for weights, gradients and Adam's moments and (.*) for its positional "
                        r"tables, and this process has 1.00 KiB\): lower model.d_model, .*\n", result.output), \
        result.output
    parameters = int(re.search(r"training its ([\d,]+)", result.output).group(1).replace(",", ""))
    tables = table_bytes(load_config(config).model)
    assert f"at least {human_bytes(16 * parameters)} for weights, gradients and Adam's moments and " \
           f"{human_bytes(tables)} for its positional tables" in result.output
    monkeypatch.setattr(run_setup, "memory_bytes", lambda device: 16 * parameters + tables)  # just enough: trains
    monkeypatch.setattr(run_setup, "build_model", build_model)
    assert runner.invoke(app, ["train", str(config), "--output-dir", str(tmp_path / "fits")]).exit_code == 0
    # positional tables far longer than the weights: model.max_len is the setting to lower, and the run is
    # refused, on this machine's memory, before the tables are built (an 8 GB float64 range first, for these)
    monkeypatch.undo()
    monkeypatch.setattr(run_setup, "build_model", lambda *args: pytest.fail("the model was built"))
    for positional in ("sinusoidal", "learned", "rope"):  # tables built, learned as weights, rope's rotations
        long = write_config(tmp_path / "long.yaml", model={"max_len": 10**9, "positional": positional})
        result = runner.invoke(app, ["train", str(long), "--output-dir", str(tmp_path / "long")])
        assert result.exit_code == 1 and result.output.strip().endswith(
            "its positional tables have a row for each of model.max_len's 1,000,000,000 positions; lower "
            "model.max_len to what the data needs (data.max_length is 48)"), (positional, result.output)


def test_an_error_during_training_stops_the_live_progress_display(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    import tformer_cli.render as render
    import tformer_cli.train as training
    from conftest import write_config
    from tformer_cli.errors import DivergedError

    terminal = io.StringIO()
    monkeypatch.setattr(render, "err_console", Console(file=terminal, force_terminal=True))
    displays = []

    class Recorded(render.TrainProgress):
        def _on_start(self, data):
            super()._on_start(data)
            displays.append(self.progress)

    def diverging(config, run_dir, resume, callback, workers):
        callback("start", {"run_dir": str(run_dir), "device": "cpu", "processes": 1, "resumed_at": 0,
                           "parameters": 10, "train_pairs": 5, "validation_pairs": 0, "dropped_long": 0,
                           "dropped_empty": 0, "truncated": 0, "steps_per_epoch": 1, "batches_per_step": 1,
                           "total_steps": 4, "vocab_size": 20, "epoch": 0, "compiled": True, "precision": "fp32"})
        raise DivergedError("training diverged at step 1: the weights are no longer finite")

    monkeypatch.setattr(render, "TrainProgress", Recorded)
    monkeypatch.setattr(training, "train", diverging)
    result = runner.invoke(app, ["train", str(write_config(tmp_path / "t.yaml")), "--output-dir",
                                 str(tmp_path / "run")])
    assert result.exit_code == 1 and "training diverged at step 1" in terminal.getvalue()
    assert "compiling the model (train.compile): the first steps take a few minutes" in terminal.getvalue()
    assert len(displays) == 1 and not displays[0].live.is_started  # stopped, so the error prints below it


def test_the_live_line_fits_an_80_column_terminal(monkeypatch):
    """Where Rich cannot fit the live line it cuts its columns short: at 80 columns the step count and
    the time left were '…'. The line holds them at 100,000 steps, with a GPU's figures."""
    import io

    from rich.console import Console

    import tformer_cli.render as render

    terminal = io.StringIO()
    monkeypatch.setattr(render, "err_console", Console(file=terminal, force_terminal=True, width=80, color_system=None))
    progress = render.TrainProgress()
    progress("start", {"run_dir": "runs/x", "device": "cuda", "processes": 1, "resumed_at": 0, "parameters": 10,
                       "train_pairs": 5, "validation_pairs": 0, "dropped_long": 0, "dropped_empty": 0, "truncated": 0,
                       "steps_per_epoch": 1, "batches_per_step": 2, "total_steps": 100_000, "vocab_size": 20,
                       "epoch": 0, "compiled": False, "precision": "bf16"})
    progress("step", {"step": 12_345, "total_steps": 100_000, "epoch": 3, "loss": 3.4561, "ppl": 31.7, "lr": 1e-3,
                      "tokens_per_s": 413_412.0, "mfu": 0.65, "gpu_peak_mib": 42_394, "elapsed": 1234.0})
    line = progress.progress.get_renderable()
    progress.close()
    shown = Console(file=io.StringIO(), width=80, color_system=None)
    shown.print(line)
    text = shown.file.getvalue().strip()
    assert "12345/100000 loss 3.456 lr 1.0e-03 413,412 tok/s MFU 0.65 41.4 GiB ETA" in text and "…" not in text, text
    assert "1 steps an epoch of 2 batches a process" in " ".join(terminal.getvalue().split())
    assert "runs/x on cuda in bf16:" in terminal.getvalue()  # the precision train.precision: auto chose


def test_average_and_plot_commands_on_a_run(tmp_path):
    config = write_config(tmp_path / "a.yaml", train={"max_steps": 6, "eval_every": 2, "keep_last": 3,
                                                      "eval_max_sentences": 5}, data={"max_samples": 100})
    run = tmp_path / "run"
    train(load_config(config), run)
    runner = CliRunner()
    result = runner.invoke(app, ["average", str(run), "--last", "2", "--json"])
    assert result.exit_code == 0, result.output
    averaged = run / "checkpoints" / "average-last-2"
    assert json.loads(result.stdout) == {"checkpoint": str(averaged),
                                         "averaged": [p.name for p in step_checkpoints(run)[-2:]]}
    mean = load_file(str(averaged / "model.safetensors"))
    a, b = (load_file(str(p / "model.safetensors")) for p in step_checkpoints(run)[-2:])
    assert mean.keys() == a.keys()
    for name in mean:
        torch.testing.assert_close(mean[name], (a[name] + b[name]) / 2)
    assert find_weights(averaged) == (run, averaged / "model.safetensors")
    generated = runner.invoke(app, ["generate", str(averaged), "seven"])
    assert generated.exit_code == 0 and len(generated.stdout.splitlines()) == 1
    outside = runner.invoke(app, ["average", str(run / "checkpoints" / "step-00000006"), "--last", "2",
                                  "--output", str(tmp_path / "average")])  # a checkpoint names its run, too
    assert outside.exit_code == 0, outside.output
    assert {p.name for p in (tmp_path / "average").iterdir()} == {"model.safetensors", "config.yaml", "tokenizer.json"}
    assert (tmp_path / "average" / "model.safetensors").read_bytes() == (averaged / "model.safetensors").read_bytes()
    standalone = runner.invoke(app, ["generate", str(tmp_path / "average"), "seven"])
    assert standalone.exit_code == 0 and standalone.stdout == generated.stdout
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "tokenizer.json").write_text("{}")
    refused = runner.invoke(app, ["average", str(run), "--last", "2", "--output", str(foreign)])
    assert refused.exit_code == 1 and "holds a tokenizer.json of its own" in refused.output
    assert [p.name for p in foreign.iterdir()] == ["tokenizer.json"]
    assert (foreign / "tokenizer.json").read_text() == "{}"
    other_run = runner.invoke(app, ["average", str(run), "--last", "2", "--output", str(tmp_path / "average" / "x")])
    assert other_run.exit_code == 1 and "inside another run folder" in other_run.output
    best = choose_checkpoints(run, best=1)
    assert len(best) == 1
    with pytest.raises(UsageError):
        choose_checkpoints(run)
    kept = len(step_checkpoints(run))
    too_many = runner.invoke(app, ["average", str(run), "--last", str(kept + 1)])
    assert too_many.exit_code == 1 and too_many.output.startswith(f"error: --last {kept + 1}: ")
    assert f"keeps only {kept} step checkpoints" in too_many.output.replace("\n", " ")
    plotted = runner.invoke(app, ["plot", str(run), "--output", str(tmp_path / "curves.png")])
    assert plotted.exit_code == 0 and (tmp_path / "curves.png").stat().st_size > 1000
    as_json = runner.invoke(app, ["plot", str(run), "--output", str(tmp_path / "curves.svg"), "--json"])
    splits = [r["split"] for r in read_jsonl(run / "metrics.jsonl")]
    assert json.loads(as_json.stdout) == {"image": str(tmp_path / "curves.svg"), "train_points": splits.count("train"),
                                          "validation_points": splits.count("validation")}
    assert splits.count("validation") == 3 and (tmp_path / "curves.svg").is_file()
    unknown = runner.invoke(app, ["plot", str(run), "--output", str(tmp_path / "curves.jpeg")])
    assert unknown.exit_code == 1 and "use a .png, .svg or .pdf file name" in unknown.output
    assert "Traceback" not in unknown.output and not (tmp_path / "curves.jpeg").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_output_redirected_to_a_full_disk_is_one_line(tmp_path):
    with open("/dev/full", "w") as full:
        results = [subprocess.run([sys.executable, "-m", "tformer_cli", *args], stdout=full, stderr=subprocess.PIPE,
                                  text=True) for args in (["--version"], ["count-params", "--d-model", "64"])]
    for result in results:  # whether the stream fails while the command line is read or as the command runs
        assert result.returncode == 1 and result.stderr.strip() == (
            "error: a write failed (No space left on device): free space on the disk and run the command again")


def test_text_out_is_utf8_whatever_the_locale(trained_run, monkeypatch):
    """Output goes out as UTF-8 even where Python's streams are ASCII or a Windows code page (a locale
    unset, a redirect on Windows): hypotheses and messages repeat the user's UTF-8 text."""
    import io

    from tformer_cli.cli import main

    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="ascii") for _ in range(2))
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr("sys.argv", ["tformer", "generate", str(trained_run), "eins", "--prefix", "fünf €"])
    with pytest.raises(SystemExit) as stop:
        main()
    err.flush()
    assert stop.value.code == 1
    assert "'€'" in err.buffer.getvalue().decode("utf-8")  # the character the target vocabulary lacks


def test_json_output_is_strict_json(capsys):
    """NaN and infinities are not JSON (jq and browsers reject them): --json prints them as null."""
    from tformer_cli.render import print_json

    print_json({"loss": float("nan"), "ppl": float("inf"), "scores": [-float("inf"), 1.5], "text": "fünf"})
    assert capsys.readouterr().out == '{"loss": null, "ppl": null, "scores": [null, 1.5], "text": "fünf"}\n'


def test_eval_reads_a_run_whose_config_names_its_data_from_home(run_dir, tmp_path, monkeypatch):
    """A run's config.yaml edited to name its dataset folder as ~/numbers reads that folder, as training would;
    it said 'no such folder' of a folder that exists."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    home = tmp_path / "home"
    home.mkdir()
    (home / "numbers").symlink_to(config["data"]["dataset"])
    monkeypatch.setenv("HOME", str(home))
    config["data"]["dataset"] = "~/numbers"
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    args = ["--max-samples", "5", "--beam", "1", "--json"]
    result = runner.invoke(app, ["eval", str(run), *args])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sentences"] == 5
    assert json.loads(result.stdout)["bleu"] == json.loads(runner.invoke(app, ["eval", str(run_dir), *args]).stdout)["bleu"]

"""The benchmark suite runs end to end (tformer against torch's nn.Transformer, the peer that needs no
extra install) and writes the records its README table is built from."""

import json
import re
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"


def test_one_run_writes_medians_and_the_ratio_to_the_peer(tmp_path):
    out = tmp_path / "results.json"
    subprocess.run([sys.executable, str(RUN), "--workloads", "train,greedy", "--sizes", "host", "--train-batch", "8",
                    "--peers", "torch", "--repeats", "1", "--warmup", "0", "--json", str(out)], check=True,
                   capture_output=True)  # the smallest size, 64 wide: the run's processes, not its arithmetic
    results = json.loads(out.read_text())
    assert results["meta"]["precision"] == "fp32" and results["meta"]["matmul_peak_flops"] > 0
    records = {(r["workload"], r["system"]): r for r in results["records"]}
    assert {("train", "tformer"), ("train", "torch nn.Transformer"), ("train", "torch nn.Transformer +fused AdamW"),
            ("greedy", "tformer"), ("greedy", "torch nn.Transformer")} == set(records)
    for workload in ("train", "greedy"):
        ours = records[(workload, "tformer")]
        best = max(r["median"] for (w, system), r in records.items() if w == workload and system != "tformer")
        assert ours["min"] <= ours["median"] <= ours["max"]
        assert ours["ratio_vs_best_peer"] == pytest.approx(ours["median"] / best)
    assert 0 < records[("train", "tformer")]["mfu"] < 1
    assert all(0 <= r["warmup_s"] < 0.1 for r in records.values())  # the warm-up's time alone: none asked for


@pytest.fixture
def run(monkeypatch):
    """benchmarks/run.py as a module: its functions, and ``main(argv)`` in this process."""
    import importlib.util

    monkeypatch.syspath_prepend(str(RUN.parent))
    spec = importlib.util.spec_from_file_location("bench_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, message", [
    (["--workloads", "train,infer", "--sizes", "small"],
     "--workloads: unknown infer; choose from train, greedy, beam, memory, data"),
    (["--accel-skip", "dropout,lossy"],
     "--accel-skip: unknown lossy; choose from linear, gemm, dropout, attention, runtime, loss, graphs"),
    (["--repeats", "0"], "--repeats: '0' is not a whole number of at least 1"),
], ids=["workloads", "accel-skip", "repeats"])
def test_a_mistaken_flag_is_a_one_line_error(run, capsys, args, message):
    with pytest.raises(SystemExit) as exited:
        run.main(args)
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def test_the_table_says_whether_batching_stalls_a_training_step(run, capsys):
    record = {"workload": "data", "size": "Multi30k", "system": "tformer", "median": 26732.7, "min": 26732.7,
              "max": 26732.7, "unit": "pairs/s", "collate_ms_per_batch": 0.117, "collate_share_of_step": 0.00049}
    run.print_table([record], "cpu (2 cores)", 4.8e11)
    assert "collate 0.12 ms a batch, 0.05 % of a step" in capsys.readouterr().out


def test_tformers_own_variants_are_not_counted_as_peers_and_each_gets_its_ratio(run):
    records = [{"workload": "train", "size": "base", "system": system, "median": median}
               for system, median in (("tformer", 100.0), ("tformer +compile", 150.0), ("Marian", 50.0))]
    run.add_ratios(records)
    assert [r.get("ratio_vs_best_peer") for r in records] == [2.0, 3.0, None]


@pytest.mark.parametrize("variant", ["splitmix", "torch"])
def test_the_dropout_experiments_variant_is_the_speed_layer_that_training_builds(tmp_path, monkeypatch, variant):
    """dropout_experiment.py compares two speed layers by swapping what training builds its model with:
    the model a run sets up has the variant's dropout and attention (torch's own with 'torch')."""
    sys.path.insert(0, str(RUN.parent))
    import torch
    from dropout_experiment import use_variant

    import tformer_cli.run_setup as run_setup
    from conftest import write_config
    from tformer_cli.accel.attention import CpuAttention
    from tformer_cli.accel.dropout import FastDropout
    from tformer_cli.config import load_config
    from tformer_cli.parallel import Workers

    monkeypatch.setattr(run_setup, "accelerate", run_setup.accelerate)  # put back after the test
    use_variant(variant)
    config = load_config(write_config(tmp_path / "d.yaml", model={"dropout": 0.1}))
    model = run_setup.Setup(config, tmp_path / "run", False, torch.device("cpu"), lambda *args: None, Workers()).model
    kinds = {type(module) for module in model.modules()}
    assert ({FastDropout, CpuAttention} <= kinds) == (variant == "splitmix")
    assert (torch.nn.Dropout in kinds) == (variant == "torch")


def test_paper_scale_batches_have_real_lengths_and_the_papers_tokens_a_step():
    sys.path.insert(0, str(RUN.parent))
    import torch
    from systems import BOS, EOS, PAD, SIZES, paper_batches, paper_lengths

    src, tgt = (torch.tensor(side, dtype=torch.float) for side in paper_lengths(100_000, torch.Generator()))
    assert 26 <= tgt.mean() <= 28 and 0.001 < (tgt > 100).float().mean() < 0.01  # mean ~27, a tail past 100
    assert 0.95 < src.mean() / tgt.mean() < 1.05
    batches = paper_batches(SIZES["small"], 25_000, 10, torch.device("cpu"))
    # cut from a corpus of WMT's size, a step spans few lengths: little padding (from a few steps' worth of
    # pairs, 21,651 target tokens a step); taken at evenly spaced points of the length order
    assert len(batches) == 10 and sum(b.target_tokens for b in batches) > 0.9 * 10 * 25_000
    longest = [b.tgt_out.shape[1] for b in batches]
    assert longest == sorted(longest) and longest[0] < 20 < 50 < longest[-1]
    for b in batches:  # batched as tformer train batches: padded tokens of the longer side within the budget
        assert b.src.numel() <= 25_000 and b.tgt_out.numel() <= 25_000
        assert (b.tgt_in[:, 0] == BOS).all() and ((b.tgt_out == EOS).sum(dim=1) == 1).all()
        assert ((b.src == EOS).sum(dim=1) == 1).all() and (b.src[:, 0] != PAD).all()


def test_paper_scale_decoding_translates_a_test_set_batched_by_tokens():
    sys.path.insert(0, str(RUN.parent))
    import torch
    from systems import EOS, PAD, SIZES, paper_sources

    for beams in (1, 4):  # hypothesis tokens: sentences x beams x longest source
        batches = paper_sources(SIZES["small"], 3000, 8192, beams, torch.device("cpu"))
        assert sum(src.shape[0] for src, _ in batches) == 3000
        for src, new_tokens in batches:  # every sentence once, its EOS last, as many new tokens as the longest source
            assert src.numel() * beams <= 8192 and new_tokens == src.shape[1] and ((src == EOS).sum(dim=1) == 1).all()
            assert (src[:, -1] == EOS).any() and (src[:, 0] != PAD).all()


def test_a_run_cut_short_keeps_the_workloads_it_finished(run, tmp_path, monkeypatch):
    """A time limit (a lent GPU's, a CI job's) that stops the suite mid-way leaves the finished
    workloads' records in --json, ratios included."""
    def fake_speed(workload, size, args, peers, peak):
        if workload == "greedy":
            raise KeyboardInterrupt  # the limit strikes during the second workload
        return [{"workload": workload, "size": size, "system": system, "median": median, "min": median,
                 "max": median, "unit": "tokens/s"} for system, median in (("tformer", 300.0), ("torch", 200.0))]

    monkeypatch.setattr(run, "run_speed_fresh", fake_speed)
    monkeypatch.setattr(run, "matmul_peak", lambda device, precision: 1e12)
    out = tmp_path / "results.json"
    with pytest.raises(KeyboardInterrupt):
        run.main(["--workloads", "train,greedy", "--sizes", "small", "--peers", "torch", "--json", str(out)])
    records = json.loads(out.read_text())["records"]
    assert [(r["workload"], r["system"]) for r in records] == [("train", "tformer"), ("train", "torch")]
    assert records[0]["ratio_vs_best_peer"] == pytest.approx(1.5)


@pytest.mark.slow  # torch.compile of a tiny nn.Transformer with inductor's C++ backend: ~15 s
def test_the_compiled_peer_compiles_once_for_every_shape_and_computes_what_the_eager_one_does(monkeypatch):
    monkeypatch.syspath_prepend(str(RUN.parent))
    import systems
    import torch
    from torch._dynamo.utils import counters

    size = systems.Size("tiny", 32, 1, 2, 64, 50)
    eager = systems.TorchBuiltin(size, torch.device("cpu"))
    monkeypatch.setattr(systems, "COMPILE_PEERS", True)
    compiled = systems.TorchBuiltin(size, torch.device("cpu"))
    compiled.model.load_state_dict(eager.model.state_dict())
    for peer in (eager, compiled):
        peer.model.eval()  # no dropout: the same logits
    torch._dynamo.reset()
    counters.clear()
    for sentences, source, target in [(3, 7, 7), (5, 9, 4), (2, 4, 11)]:  # equal lengths first: duck sizing's trap
        batch = SimpleNamespace(src=torch.randint(4, 50, (sentences, source)),
                                tgt_in=torch.randint(4, 50, (sentences, target)))
        torch.testing.assert_close(compiled.logits(batch), eager.logits(batch))
    assert counters["aot_autograd"]["total"] == 1  # one dynamic graph: not a static one, then another


def test_the_suites_compiled_tformer_trains_the_model_that_a_compiled_run_trains(monkeypatch):
    """As `tformer train` with train.compile: without the speed layer's modules, which break the graph
    on a CPU; the eager system keeps them."""
    monkeypatch.syspath_prepend(str(RUN.parent))
    import systems
    import torch

    from tformer_cli.accel.dropout import FastDropout

    size = systems.Size("tiny", 32, 1, 2, 64, 50)
    for system, swapped in ((systems.Tformer, True), (systems.TformerCompiled, False),
                            (systems.TformerLayersCompiled, False), (systems.TformerCompiledPacked, False)):
        model = system(size, torch.device("cpu")).model
        assert any(isinstance(m, FastDropout) for m in model.modules()) == swapped, system.__name__
        assert any(type(m) is torch.nn.Dropout for m in model.modules()) != swapped, system.__name__


@pytest.mark.slow  # ~20 s: the profiler's events of a decoding batch take seconds to read
def test_the_step_profile_sorts_a_steps_time_into_kinds_on_a_cpu():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_step.py"
    result = subprocess.run([sys.executable, str(script), "--device", "cpu", "--size", "host", "--tokens", "300",
                             "--steps", "1", "--sentences", "3", "--no-compile", "--attention", "math,explicit",
                             "--loss-chunks", "64"],
                            capture_output=True, text=True, check=True)
    sections = [line for line in result.stdout.splitlines() if line.startswith("== ")]
    assert [s.split(":")[0] for s in sections[2:]] == [
        "== train, eager", "== train, eager, the loss unfused", "== train, eager, attention by MATH",
        "== train, eager, attention explicit (bf16 products, fp32 softmax)",
        "== train, eager, the loss 64 tokens a chunk"]
    assert sections[0].startswith("== greedy") and sections[1].startswith("== beam 4")
    assert all("busy" in s for s in sections)
    assert "matmul" in result.stdout and "costliest:" in result.stdout
    assert len(re.findall(r"target tokens/s, MFU 0\.\d{3}", result.stdout)) == 5  # each training variant


def test_packed_attention_computes_what_the_padded_model_computes_on_a_cpu(monkeypatch, capsys):
    """attention_packing.py checks each layout's output against the padded call at the real positions
    (for the encoder's, the decoder's causal and the cross-attention) before it times them."""
    monkeypatch.syspath_prepend(str(RUN.parent))
    from attention_packing import main

    main(["--device", "cpu", "--size", "small", "--tokens", "600", "--steps", "2", "--row", "64", "--variants",
          "padded,packed", "--repeats", "1"])
    out = capsys.readouterr().out
    table = {line[:14].strip(): line[14:].split() for line in out.splitlines()[1:]}
    assert table[""] == ["padded", "packed"]  # the packed layout is not left out for differing from padded
    assert set(table) == {"", "encoder self", "decoder self", "cross", "all"}
    assert all(float(ms) > 0 for row in ("encoder self", "decoder self", "cross", "all") for ms in table[row])


@pytest.mark.slow  # compiles the explicit attention for each batch and kind, ~15 s
def test_the_compiled_explicit_attention_computes_what_the_padded_model_computes_on_a_cpu():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "attention_packing.py"
    result = subprocess.run([sys.executable, str(script), "--device", "cpu", "--size", "small", "--tokens", "600",
                             "--steps", "2", "--variants", "padded,explicit", "--repeats", "1"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "explicit:" not in result.stdout  # not left out for differing from padded (or failing)
    assert result.stdout.splitlines()[1].split() == ["padded", "explicit"]


def test_a_packed_row_holds_whole_sentences_up_to_its_length(monkeypatch):
    monkeypatch.syspath_prepend(str(RUN.parent))
    from attention_packing import rows_of

    lengths = [30, 40, 50, 20, 130, 10, 60]
    rows = rows_of(lengths, 128)
    assert [i for row in rows for i in row] == list(range(len(lengths)))  # every sentence once, in order
    assert rows == [[0, 1, 2], [3], [4], [5, 6]]  # 130 alone: longer than a row


def test_the_memory_prediction_counts_each_storage_while_it_lives():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    sys.path.insert(0, str(RUN.parent))
    from predict_memory import LiveBytes

    with FakeTensorMode(), LiveBytes() as live:
        a = torch.empty(2**18)  # 1 MiB
        b = a * 2  # 2 MiB live
        view = b[::2]  # no new storage
        b.add_(1)  # nor here
        del a  # 1 MiB
        c = b + view.sum()  # a 4-byte scalar and another MiB
        del b, view, c
    assert (live.peak, live.now) == (2 * 2**20 + 4, 0)


@pytest.mark.slow  # traces two systems' training steps, ~9 s
def test_the_memory_prediction_compares_tformer_with_the_lowest_peer():
    script = RUN.parent / "predict_memory.py"
    result = subprocess.run([sys.executable, str(script), "--sizes", "host", "--sentences", "4", "--systems",
                             "tformer,torch"], capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["host", "tformer"], ["host", "torch"]]
    assert "tformer / the lowest peer (torch):" in lines[2]


@pytest.mark.slow  # three predictions, ~13 s
def test_the_memory_prediction_takes_profile_steps_experiments():
    """The explicit path saves each attention call's scores for the backward pass; a bf16 residual stream
    halves what the layer norms and residual adds save."""
    script = RUN.parent / "predict_memory.py"

    def peak(*experiments: str) -> float:
        result = subprocess.run([sys.executable, str(script), "--sizes", "host", "--tokens", "800", "--steps", "1",
                                 "--systems", "tformer", *experiments], capture_output=True, text=True, check=True)
        return float(result.stdout.split()[2].replace(",", ""))

    plain, explicit, stream = peak(), peak("--explicit-attention"), peak("--bf16-stream")
    assert explicit > plain > stream


@pytest.mark.slow  # compiles twice, ~10 s
def test_a_compiled_variant_held_to_math_attention_runs_it_after_another_compiled_the_same_graph(
        monkeypatch, tmp_path):
    """The compile caches' keys leave out the attention kernel held by ``sdpa_kernel``: without a
    cache of its own, profile_step's math variant ran the flash kernel compiled before it."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.syspath_prepend(str(RUN.parent))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from profile_step import compile_cache_for

    q, k, v = (torch.randn(2, 2, 8, 16, requires_grad=True) for _ in range(3))

    def operators(backend):
        torch._dynamo.reset()  # as profile_step compiles each variant afresh
        attend = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v).sum())
        held = sdpa_kernel(backend) if backend is not None else nullcontext()
        with compile_cache_for(backend), held, torch.profiler.profile() as profile:
            attend(q, k, v).backward()
        return {event.name for event in profile.events()}

    default, math = operators(None), operators(SDPBackend.MATH)
    assert any("flash_attention" in name for name in default)
    assert not any("flash_attention" in name for name in math) and "aten::bmm" in math


def test_the_explicit_attention_experiment_computes_the_models_attention(monkeypatch):
    """profile_step's ``--compile-attention explicit`` swaps the model's explicit path in for every
    attention call: the same logits as the plain model's fused kernel, with a padded source."""
    import torch

    from tformer_cli.config import ModelConfig
    from tformer_cli.model import build_model

    monkeypatch.syspath_prepend(str(RUN.parent))
    from profile_step import ExplicitAttention, explicit_attention

    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=64),
                        50).eval()
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    src[0, 4:] = 0  # padding
    expected = model(src, tgt)
    explicit_attention(model)
    swapped = [m for m in model.modules() if isinstance(m, ExplicitAttention)]
    assert len(swapped) == 2 + 2 * 2  # each encoder layer's, each decoder layer's two
    torch.testing.assert_close(model(src, tgt), expected)


def test_the_leases_profile_ends_with_every_lever_toward_mfu_040_at_once(monkeypatch):
    """gpu.sh's first call (its header): the compiled baselines, the bf16 stream eager and on packed
    rows, then the same with inductor's settings stacked on them, the variant that may run past the
    call's limit."""
    monkeypatch.syspath_prepend(str(RUN.parent))
    import systems
    from profile_step import parse_arguments, training_variants

    header = (RUN.parent / "gpu.sh").read_text().split("set -euo pipefail")[0]
    step = re.search(r'PROFILE_ARGS="([^"]+)" gpu.sh profile', header.replace("\n#     ", " "))
    args = parse_arguments(["--device", "cuda", *step.group(1).split()])
    variants = training_variants(args)
    packed = systems.TformerCompiledPacked
    assert [v.system for v in variants] == [systems.TformerCompiled, packed, systems.Tformer, packed, packed]
    assert [(v.bf16_stream, v.inductor) for v in variants] == [
        (False, None), (False, None), (True, None), (True, None), (True, {"max_autotune_gemm": True})]
    assert variants[-1].label == ("train, compiled, packed in rows of 128 with max_autotune_gemm=True, "
                                  "residual stream in bf16")


def test_the_flash_setting_of_the_x_transformers_peer_computes_what_its_default_computes(monkeypatch):
    """``xtransformers-flash`` is the same model with a faster attention kernel: with the same weights,
    the default's logits over paper-like batches (padded sources, causal targets)."""
    pytest.importorskip("x_transformers")
    import torch

    monkeypatch.syspath_prepend(str(RUN.parent))
    from systems import PEERS, SIZES, paper_batches

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    default, flash = PEERS["xtransformers"](SIZES["small"], cpu), PEERS["xtransformers-flash"](SIZES["small"], cpu)
    flash.model.load_state_dict(default.model.state_dict())
    default.model.eval(), flash.model.eval()
    assert (default.name, flash.name) == ("x-transformers", "x-transformers (flash)")

    def kernels(model):  # x-transformers' attention modules, by whether they call torch's fused attention
        return {module.flash for module in model.modules() if type(module).__name__ == "Attend"}

    assert kernels(default.model) == {False} and kernels(flash.model) == {True}
    for batch in paper_batches(SIZES["small"], 600, 2, cpu):
        assert (batch.src == 0).any()  # padding, masked in both
        with torch.no_grad():
            torch.testing.assert_close(flash.logits(batch), default.logits(batch), atol=1e-4, rtol=1e-4)


def test_decoding_warms_up_on_the_shortest_and_longest_batches_and_times_whole_passes(monkeypatch):
    """A whole pass over the paper-scale test set costs some peers minutes; warming up needs two batches."""
    import torch

    monkeypatch.syspath_prepend(str(RUN.parent))
    import run
    import systems

    decoded: list[int] = []

    class Counting(systems.Tformer):
        def greedy(self, src, new_tokens):  # noqa: ANN001
            decoded.append(src.shape[1])

    monkeypatch.setattr(run, "Tformer", Counting)
    monkeypatch.setattr(run, "PAPER", (600, 1, 40))
    monkeypatch.setattr(run, "PAPER_DECODE_TOKENS", 300)  # a few batches of the 40 sentences
    lengths = [src.shape[1] for src, _ in systems.paper_sources(systems.SIZES["small"], 40, run.PAPER_DECODE_TOKENS, 1,
                                                                torch.device("cpu"))]
    assert len(lengths) > 2
    run.run_speed("greedy", "small", torch.device("cpu"), [], repeats=2, warmup=1, peak=1.0)
    assert decoded == [lengths[0], lengths[-1]] + lengths * 2


GPU_SH = Path(__file__).parents[1] / "benchmarks" / "gpu.sh"
STAND_IN_PYTHON = """#!/usr/bin/env bash
# gpu.sh's train step as a stand-in: tformer train writes two figures, 1 s apart; the summary reads them
if [[ $1 == -m ]]; then
    while [[ $1 != --output-dir ]]; do shift; done
    mkdir -p "$2"
    for step in 1 2; do echo "{\\"split\\": \\"train\\", \\"step\\": $step}" >> "$2/metrics.jsonl"; sleep 1; done
else
    cat > /dev/null; echo "median tokens_per_s: 1 (stand-in)"
fi
"""


def test_the_detached_gpu_run_outlives_the_calls_whose_out_folders_are_emptied(tmp_path):
    """gpu.sh train-start, then train-wait in later device calls, each with an $OUT of its own (the device
    empties it before a call): the run, its pid and its log stay in $TRAIN_RESULTS; a wait cut short
    brings back what the run has written so far and says to wait again; the last brings back the summary."""
    python = tmp_path / "python"
    python.write_text(STAND_IN_PYTHON)
    python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(python), "TRAIN_RESULTS": str(tmp_path / "run"),
           "COMPILE_CACHE_DIR": str(tmp_path / "cache"), "COMPILE_CACHE": str(tmp_path / "none")}

    def call(step: str, out: str, code: int = 0, **more: str) -> subprocess.CompletedProcess:
        result = subprocess.run(["bash", str(GPU_SH), step], capture_output=True, text=True, timeout=60,
                                env={**env, "RESULTS": str(tmp_path / out / "r"), **more})
        assert result.returncode == code, result.stderr
        return result

    call("train-start", "out1")
    cut_short = call("train-wait", "out2", WAIT_SECONDS="1")
    assert "train-wait again" in cut_short.stdout
    assert (tmp_path / "out2" / "r" / "train.log").is_file()
    finished = call("train-wait", "out3")
    assert "median tokens_per_s: 1 (stand-in)" in finished.stdout and "again" not in finished.stdout
    assert len((tmp_path / "out3" / "r" / "metrics.jsonl").read_text().splitlines()) == 2
    # on a fresh machine (the one that trained went back) there is nothing to wait for: one line
    fresh = call("train-wait", "out4", code=1, TRAIN_RESULTS=str(tmp_path / "fresh"))
    assert fresh.stderr.startswith("no run started by train-start on this machine")

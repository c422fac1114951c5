import math
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import HostReads, tiny_batch, tiny_model_config, train_step, write_config
from tformer_cli.batching import Batch, token_batches
from tformer_cli.config import load_config
from tformer_cli.errors import CheckpointError, UsageError
from tformer_cli.evaluation import label_smoothed_loss
from tformer_cli.model import build_model
from tformer_cli.optim import learning_rate
from tformer_cli.parallel import Workers
from tformer_cli.run_folder import step_checkpoints
from tformer_cli.runs import prepare_run
from tformer_cli.runtime import load_run
from tformer_cli.train import train
from tformer_cli.train_plan import no_step


def test_a_training_step_is_the_loss_backward_clipping_the_schedule_and_adam():
    """train's optimizer step against the step written out: the label-smoothed loss over the batch's
    target tokens, backward, the gradient norm clipped, the schedule's learning rate, Adam's update."""
    import copy

    from tformer_cli.config import TrainConfig
    from tformer_cli.optim import make_optimizer

    config = tiny_model_config()
    ours = build_model(config, 40)
    reference = copy.deepcopy(ours).train()
    settings = dict(lr=2.0, schedule="inverse_sqrt", warmup_steps=3, clip_grad_norm=0.5, label_smoothing=0.1)
    step, optimizer = train_step(ours, config, **settings), make_optimizer(reference, TrainConfig(**settings), "cpu")
    generator = torch.Generator().manual_seed(0)
    for number in range(1, 4):
        src, tgt = torch.randint(4, 40, (6, 9), generator=generator), torch.randint(4, 40, (6, 8), generator=generator)
        tgt[::2, 5:] = 0  # padding: the loss is over real tokens only
        batch = Batch(src, tgt[:, :-1], tgt[:, 1:], list(range(6)))
        step(batch)
        loss, _ = label_smoothed_loss(reference, batch, 0.1)
        (loss / batch.num_tokens).backward()
        assert torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5) > 0.5  # the clipping acts
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(number, TrainConfig(**settings), config.d_model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_cosine_bounded_by_epochs_reaches_min_lr_on_the_last_step(tmp_path):
    path = write_config(tmp_path / "c.yaml", data={"max_samples": 300},
                        train={"schedule": "cosine", "lr": 1e-3, "min_lr": 1e-5, "warmup_steps": 2, "epochs": 1,
                               "max_steps": None, "log_every": 1, "eval_every": 1000, "eval_bleu": False})
    events = []
    train(load_config(path), tmp_path / "run", callback=lambda e, d: events.append((e, d)))
    lrs = [d["lr"] for e, d in events if e == "step"]
    assert len(lrs) > 4 and math.isclose(lrs[1], 1e-3) and math.isclose(lrs[-1], 1e-5)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))


def _resume_warnings(run: Path, overrides: list[str]) -> list[str]:
    """The warnings of resuming ``run`` with ``overrides``."""
    events = []
    config, run_dir = prepare_run(None, run, overrides, None)
    train(config, run_dir, resume=True, callback=lambda event, data: events.append((event, data)))
    return [data["message"] for event, data in events if event == "warning"]


def test_raising_a_cosine_runs_limit_on_resume_warns_that_its_rate_rises_and_says_how_to_go_on(tmp_path):
    import shutil

    path = write_config(tmp_path / "c.yaml", train={"schedule": "cosine", "lr": 1e-3, "min_lr": 1e-5, "warmup_steps": 1,
                                                    "max_steps": 8, "eval_every": 2, "keep_last": 4})
    train(load_config(path), tmp_path / "run")

    def warnings(overrides: list[str]) -> list[str]:
        return _resume_warnings(tmp_path / "run", overrides)

    for later in ("step-00000006", "step-00000008"):  # stopped at step 4: the decay goes on where it was
        shutil.rmtree(tmp_path / "run" / "checkpoints" / later)
    assert warnings([]) == []
    longer = replace(load_config(path).train, max_steps=12)
    assert warnings(["train.max_steps=12"]) == [
        f"the learning rate rises from 1e-05 at step 8 to {learning_rate(9, longer, 0):.3g}: the cosine schedule decays "
        "over train.max_steps (or epochs, max_time), so raising them stretches its whole decay; to go on at the rate "
        "reached, resume with --set train.schedule=constant --set train.lr=1e-05"]
    assert warnings(["train.max_steps=14", "train.schedule=constant", "train.lr=1e-5"]) == []  # as it advised


@pytest.mark.parametrize("train", [{"clip_grad_norm": 1.0, "schedule": "cosine", "max_steps": 10, "warmup_steps": 1},
                                   {"label_smoothing": 0.1, "rdrop": 0.5, "precision": "bf16"}])
def test_a_training_step_reads_nothing_back_from_the_device(train):
    """No op of a step waits for the device's values (``.item()``, ``nonzero``, a boolean mask): on a GPU
    the host queues step after step while the device works. Its loss stays on the device until logged."""
    model_config = tiny_model_config(dropout=0.1)
    step = train_step(build_model(model_config, 40).train(), model_config, **train)
    batch = tiny_batch()
    step(batch)  # the first makes the optimizer's state
    with HostReads() as reads:
        step(batch)
        step(batch)
    assert reads.seen == []


def test_a_tiny_model_overfits_one_batch():
    model = build_model(tiny_model_config(dropout=0.0), 30)
    src = torch.randint(4, 30, (4, 7))
    tgt = torch.cat([torch.ones(4, 1, dtype=torch.long), torch.randint(4, 30, (4, 6))], dim=1)
    batch = Batch(src, tgt[:, :-1], tgt[:, 1:], list(range(4)))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss, nll = label_smoothed_loss(model, batch, 0.0)
        optimizer.zero_grad()
        (loss / batch.num_tokens).backward()
        optimizer.step()
    assert nll.item() / batch.num_tokens < 0.05


def test_loss_goes_down_on_the_demo_data(tmp_path):
    path = write_config(tmp_path / "demo.yaml", train={"max_steps": 40, "eval_every": 20, "log_every": 5,
                                                       "eval_bleu": False},
                        data={"max_samples": 2000})
    events = []
    result = train(load_config(path), tmp_path / "run", callback=lambda e, d: events.append((e, d)))
    losses = [d["loss"] for e, d in events if e == "step"]
    evals = [d["loss"] for e, d in events if e == "eval"]
    assert losses[-1] < 0.8 * losses[0]
    assert evals[-1] < evals[0]
    assert result.stop_reason == "reached train.max_steps 40"
    run = tmp_path / "run"
    for name in ("config.yaml", "tokenizer.json", "model.safetensors", "metrics.jsonl"):
        assert (run / name).is_file(), name
    assert [p.name for p in step_checkpoints(run)] == ["step-00000020", "step-00000040"]


def test_training_tokens_per_second_leave_out_validation_and_checkpoints(tmp_path, monkeypatch):
    path = write_config(tmp_path / "t.yaml", train={"max_steps": 4, "log_every": 2, "eval_every": 2,
                                                    "eval_bleu": False})
    rates, clock = [], [0.0]

    def ticks() -> float:  # a clock that advances 1 ms a reading, whatever the machine's load
        clock[0] += 1e-3
        return clock[0]

    def slow_validation(event, data):
        if event == "evaluating":
            clock[0] += 1000.0  # a validation of 1,000 s
        if event == "step":
            rates.append(data["tokens_per_s"])

    monkeypatch.setattr(time, "perf_counter", ticks)
    train(load_config(path), tmp_path / "run", callback=slow_validation)
    assert len(rates) == 2 and rates[1] > 0.3 * rates[0]  # steps 3-4 follow the validation of step 2


def test_training_logs_model_flops_and_their_share_of_the_measured_peak(tmp_path):
    """tflops: target tokens/s x the training FLOPs of a target token (params.train_flops_per_token at
    the training data's source tokens per target token); mfu: that over the product peak measured here."""
    from tformer_cli.data import read_pairs
    from tformer_cli.params import train_flops_per_token
    from tformer_cli.devices import matmul_peak, resident_mib
    from tformer_cli.run_folder import read_metrics

    config = load_config(write_config(tmp_path / "f.yaml", train={"max_steps": 4, "log_every": 2}))
    peak_before = resident_mib(peak=True)
    train(config, tmp_path / "run")
    if peak_before is not None:  # the process's resident peak, which getrusage and `time -v` report, left alone
        assert resident_mib(peak=True) >= peak_before
    vocab = load_run(tmp_path / "run").vocab
    pairs = list(read_pairs(config.data, config.data.train_split))
    sources = sum(map(len, vocab.encode_sources([s for s, _ in pairs])))
    targets = sum(len(t) - 1 for t in vocab.encode_targets([t for _, t in pairs]))  # the tokens after <s>
    per_token = train_flops_per_token(config.model, vocab.tgt_size, sources / targets)
    logged = [r for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert [r["step"] for r in logged] == [2, 4]
    for record in logged:
        assert math.isclose(record["tflops"] * 1e12, record["tokens_per_s"] * per_token, rel_tol=1e-9)
        assert math.isclose(record["mfu"], record["tflops"] * 1e12 / matmul_peak(torch.device("cpu"), "fp32"))
        assert 0 < record["mfu"] < 1
        if Path("/proc/self/status").exists():  # the process's resident memory (Linux)
            assert 50 < record["rss_mib"] < 24 * 1024
        assert "gpu_peak_mib" not in record


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(step_checkpoints(run_dir)[-1] / "model.safetensors"))


def test_train_compile_auto_compiles_on_a_gpu_that_triton_supports_and_not_on_a_cpu(monkeypatch):
    """auto compiles on a GPU where torch.compile can (Triton installed, compute capability 7.0 or later),
    and true asks for it anywhere: where it cannot, one line says why, before the model is built."""
    import importlib.util

    from tformer_cli.errors import ConfigError
    from tformer_cli.evaluation import compiles

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla P100-PCIE-16GB")  # the old GPU
    for capability, triton, compiled in (((9, 0), True, True), ((7, 0), True, True), ((6, 0), True, False),
                                         ((8, 0), False, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(importlib.util, "find_spec",  # triton installed or not (the CPU wheel has none)
                            lambda name, *args: find_spec(name, *args) if name != "triton" else triton or None)
        assert compiles("auto", gpu) is compiled and compiles(False, gpu) is False
        if compiled:
            assert compiles(True, gpu)
        else:
            with pytest.raises(ConfigError) as refused:
                compiles(True, gpu)
            why = ("Tesla P100-PCIE-16GB has compute capability 6.0, and Triton, torch.compile's GPU compiler, needs "
                   "7.0 or later" if triton else
                   "Triton, torch.compile's GPU compiler, is not installed (pip install triton)")
            assert str(refused.value) == (f"train.compile true: {why}; set train.compile=false, or auto (compiled "
                                          "where it can be)")
    assert not compiles("auto", cpu) and compiles(True, cpu) and not compiles(False, cpu)


@pytest.mark.slow  # inductor compiles the step for about 35 s on 2 cores
def test_train_compile_takes_the_steps_the_eager_loop_takes(tmp_path):
    """``train.compile`` compiles the loss (model and fused loss together): the same losses and weights."""
    path = write_config(tmp_path / "c.yaml", model={"dropout": 0.0}, train={"max_steps": 4, "log_every": 1,
                                                                            "eval_every": 1000})
    losses = {}
    for compiled in (False, True):
        events = []
        train(load_config(path, [f"train.compile={str(compiled).lower()}"]), tmp_path / str(compiled),
              callback=lambda event, data: events.append((event, data)))
        losses[compiled] = [data["loss"] for event, data in events if event == "step"]
    assert len(losses[True]) == 4
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-5)
    eager, compiled = _weights(tmp_path / "False"), _weights(tmp_path / "True")
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # inductor compiles the step for about 15 s on 2 cores
@pytest.mark.parametrize("pack_length, accel", [(None, "off"), (64, "off"), (None, "auto")],
                         ids=["padded", "packed", "speed-layer"])
def test_a_compiled_run_compiles_one_graph_for_batches_of_every_shape(tmp_path, monkeypatch, pack_length, accel):
    """The compiled step is one graph with symbolic sizes, so batches of new shapes never recompile it,
    padded or packed into rows: on a GPU a recompile holds training for a minute or more, and past
    torch's limit of 8 a function runs eagerly from then on. The plain model is what a GPU compiles (the
    speed layer swaps in no module there); on a CPU a compiled run leaves the speed layer's modules out,
    which broke the graph into 29."""
    import torch._dynamo.utils

    import tformer_cli.train as training

    shapes, collate = set(), training.training_batch

    def seen(*args, **kwargs):
        batch = collate(*args, **kwargs)
        shapes.add((tuple(batch.src.shape), tuple(batch.tgt_in.shape)))
        return batch

    monkeypatch.setattr(training, "training_batch", seen)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    path = write_config(tmp_path / "c.yaml", data={"max_samples": 2000},
                        train={"max_steps": 24, "max_tokens": 500, "eval_every": 1000, "compile": True,
                               "accel": accel, "pack_length": pack_length})
    assert train(load_config(path), tmp_path / "run").state.step == 24
    assert len(shapes) > 8  # more than torch's recompile limit
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] == 1 and not torch._dynamo.utils.counters["graph_break"], dict(stats)
    assert torch._dynamo.utils.counters["frames"]["total"] == 1  # converted once: a recompile converts again


@pytest.mark.slow  # inductor compiles the step, for the first run and again for the resumed one
def test_a_compiled_run_resumes_as_it_would_have_gone_on(tmp_path):
    """A GPU's runs compile by default (train.compile: auto): stopped and resumed, a compiled run with
    dropout (inductor's own random numbers, seeded from the generator a checkpoint keeps) trains the
    steps a run never stopped trains, to the rounding of the compiled embedding gradient's atomic adds
    (docs/design.md: two identical compiled runs differ by ~1e-7 after 10 steps)."""
    path = write_config(tmp_path / "c.yaml", train={"max_steps": 6, "log_every": 1, "eval_every": 1000,
                                                    "compile": True})
    losses = {}
    for name, stops in (("straight", [6]), ("resumed", [3, 6])):
        events = []
        result = train(load_config(path, [f"train.max_steps={stops[0]}"]), tmp_path / name,
                       callback=lambda e, d: events.append((e, d)))
        for stop in stops[1:]:
            config, run_dir = prepare_run(None, tmp_path / name, [f"train.max_steps={stop}"], None)
            result = train(config, run_dir, resume=True, callback=lambda e, d: events.append((e, d)))
        assert [d["compiled"] for e, d in events if e == "start"] == [True] * len(stops)
        assert result.state.step == 6
        losses[name] = [d["loss"] for e, d in events if e == "step"]
    torch.testing.assert_close(losses["resumed"], losses["straight"], rtol=1e-5, atol=1e-6)
    straight, resumed = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    assert straight.keys() == resumed.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-4, atol=1e-6)
    # dropout drew masks of its own: an uncompiled run's losses are not the compiled run's
    train(load_config(path, ["train.compile=false"]), tmp_path / "eager")
    eager = _weights(tmp_path / "eager")
    assert not all(torch.allclose(eager[name], straight[name], rtol=1e-4, atol=1e-6) for name in straight)


def test_a_run_that_ends_by_train_epochs_validates_and_saves_its_last_step(tmp_path):
    """The last epoch's last step is the run's last: validated and saved, though train.eval_every and
    train.save_every do not fall on it (they did not, and the last steps' training was never written)."""
    path = write_config(tmp_path / "e.yaml", data={"max_samples": 120},
                        train={"max_steps": None, "epochs": 3, "eval_every": 4, "save_every": 4, "log_every": 1})
    events = []
    result = train(load_config(path), tmp_path / "run", callback=lambda e, d: events.append((e, d)))
    steps = result.state.step
    assert result.stop_reason == "reached train.epochs 3" and steps % 4 and result.state.epoch == 3
    assert [d["step"] for e, d in events if e == "eval"] == [*range(4, steps, 4), steps]
    assert [c.name for c in step_checkpoints(tmp_path / "run")][-1] == f"step-{steps:08d}"
    assert result.last_eval["step"] == steps
    config, run_dir = prepare_run(None, tmp_path / "run", ["train.epochs=4"], None)  # and it resumes from there
    assert train(config, run_dir, resume=True).state.step > steps


def test_resuming_gives_the_same_weights_as_training_straight_through(tmp_path):
    from safetensors.torch import load_file

    path = write_config(tmp_path / "r.yaml", train={"max_steps": 8, "eval_every": 1000, "ema_decay": 0.9})
    train(load_config(path), tmp_path / "straight")
    train(load_config(path, ["train.max_steps=3"]), tmp_path / "resumed")
    config, run_dir = prepare_run(None, tmp_path / "resumed", ["train.max_steps=8"], None)
    result = train(config, run_dir, resume=True)
    assert result.state.step == 8
    straight, resumed = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    ema = [load_file(str(run / "checkpoints" / "ema" / "model.safetensors"))
           for run in (tmp_path / "straight", run_dir)]
    assert all(torch.equal(ema[0][name], ema[1][name]) for name in straight)  # the average resumes too
    assert not all(torch.equal(ema[0][name], straight[name]) for name in straight)
    assert load_run(run_dir / "checkpoints" / "ema").weights.parent.name == "ema"  # eval and generate take it


def test_with_step_tokens_any_batches_a_step_take_the_same_steps_and_a_resume_may_change_them(tmp_path):
    """train.step_tokens cuts the steps before they are shared out: one batch a step, or two or three
    within a lower max_tokens, train the same weights (up to the order of float sums); a run stopped
    and resumed with another max_tokens goes on over the same steps."""
    path = write_config(tmp_path / "s.yaml", model={"dropout": 0.0}, train={"step_tokens": 600, "max_steps": 6})
    runs = {}
    for max_tokens in (600, 300, 200):  # 1, 2 and 3 batches a step
        result = train(load_config(path, [f"train.max_tokens={max_tokens}"]), tmp_path / str(max_tokens))
        assert result.state.accumulation == 600 // max_tokens
        runs[max_tokens] = _weights(tmp_path / str(max_tokens))
    train(load_config(path, ["train.max_steps=3", "train.max_tokens=200"]), tmp_path / "resumed")
    config, run_dir = prepare_run(None, tmp_path / "resumed", ["train.max_steps=6", "train.max_tokens=300"], None)
    train(config, run_dir, resume=True)
    runs["resumed"] = _weights(run_dir)
    for name, weights in runs.items():
        for key in weights:
            torch.testing.assert_close(weights[key], runs[600][key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    # without step_tokens the batches are max_tokens each, a step one of them: other steps
    train(load_config(path, ["train.step_tokens=null", "train.max_tokens=300"]), tmp_path / "per-batch")
    assert not torch.allclose(_weights(tmp_path / "per-batch")["encoder.layers.0.ffn.linear1.weight"],
                              runs[600]["encoder.layers.0.ffn.linear1.weight"])


def test_validating_together_each_process_takes_a_share_and_all_get_one_process_figures(tmp_path, monkeypatch):
    """Under DDP every process validates every N-th batch and translates every N-th sentence; the
    NLL sums and the translations are combined into the figures one process computes alone."""
    import tformer_cli.evaluation as evaluation
    from tformer_cli.run_setup import Setup

    scored = []
    score = evaluation.validation_scores
    monkeypatch.setattr(evaluation, "validation_scores", lambda hyps, refs: scored.append(hyps) or score(hyps, refs))
    config = load_config(write_config(tmp_path / "v.yaml", train={"eval_max_sentences": 15}))
    setup = Setup(config, tmp_path / "run", False, torch.device("cpu"), lambda *args: None, Workers())
    alone = setup.validate(setup.model, 0)

    class Share:
        """Rank ``rank`` of two; its collectives answered with what the other rank sent (``other``)."""

        def __init__(self, rank, other=None):
            self.rank, self.size, self.other, self.sent = rank, 2, other, {}

        def sum(self, *values):
            self.sent["sum"] = values
            return [a + b for a, b in zip(values, self.other["sum"])] if self.other else list(values)

        def gather(self, value):
            self.sent["gather"] = value
            return [value, self.other["gather"]] if self.other else [value]

    second = Share(1)
    setup.workers = second
    setup.validate(setup.model, 0, together=True)  # its figures need the first's share
    setup.workers = first = Share(0, second.sent)
    together = setup.validate(setup.model, 0, together=True)
    assert [len(share.sent["gather"]) for share in (first, second)] == [8, 7]  # sentences 0, 2, ... and 1, 3, ...
    assert 0 < second.sent["sum"][1] < first.sent["sum"][1] + second.sent["sum"][1]  # tokens: a share each
    assert together["loss"] == pytest.approx(alone["loss"], rel=1e-9)
    assert len(set(scored[0])) > 1 and scored[-1] == scored[0]  # the shares' translations in order again
    assert {k: together[k] for k in ("bleu", "chrf", "exact_match")} == {k: alone[k] for k in ("bleu", "chrf",
                                                                                             "exact_match")}


def test_a_split_too_small_for_a_batch_a_process_is_one_line(tmp_path):
    """Every epoch would end before its first step, and training would go round forever: one line."""
    path = write_config(tmp_path / "s.yaml", data={"max_samples": 3},
                        train={"step_tokens": 480, "max_tokens": 48})  # 10 batches a step, of 3 sentences
    with pytest.raises(UsageError, match=r"^train.step_tokens 480: no step of the training split \(3 pairs\) has a "
                       r"sentence for each of its 10 batches \(10 a process, to stay within train.max_tokens 48\); "
                       r"lower train.step_tokens or raise train.max_tokens$"):  # fewer batches a step
        train(load_config(path), tmp_path / "run")
    # a batch a process already: the step needs more sentences, or fewer processes to share them
    assert no_step(replace(load_config(path).train, step_tokens=48), 3, 4, 1).endswith(
        "batches (1 a process on 4 processes, to stay within train.max_tokens 48); raise train.step_tokens, or train "
        "with fewer processes")


@pytest.mark.parametrize("section, key, then", [("model", "attention_bias", True), ("train", "batch_multiple", 1)],
                         ids=["its-biases", "its-batches"])
def test_a_run_saved_before_a_key_existed_resumes_as_it_was_trained(tmp_path, section, key, then):
    import yaml

    sections = {"model": {}, "train": {"max_steps": 2}}
    sections[section][key] = then  # trained with the value such runs had
    path = write_config(tmp_path / "old.yaml", **sections)
    run_dir = tmp_path / "run"
    train(load_config(path), run_dir)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    del saved[section][key]  # as written before the option
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    config, _ = prepare_run(None, run_dir, ["train.max_steps=4"], None)
    assert getattr(getattr(config, section), key) == then
    assert train(config, run_dir, resume=True).state.step == 4


def test_a_resume_on_other_training_data_says_it_will_not_match_a_run_never_stopped(tmp_path):
    path = write_config(tmp_path / "d.yaml", train={"max_steps": 2})
    train(load_config(path), tmp_path / "run")

    def warnings(overrides: list[str]) -> list[str]:
        return _resume_warnings(tmp_path / "run", overrides)

    assert warnings(["train.max_steps=3"]) == []
    changed = warnings(["train.max_steps=4", "data.max_samples=200"])
    assert len(changed) == 1 and changed[0].startswith("the training split differs from the one step-00000003 was "
                                                       "trained on (200 pairs now)")
    assert warnings(["train.max_steps=5", "data.max_samples=200"]) == []  # the new data is the run's from then on
    from typer.testing import CliRunner

    from tformer_cli.cli import app

    quiet = CliRunner().invoke(app, ["train", "--resume", str(tmp_path / "run"), "--set", "train.max_steps=6",
                                     "--set", "data.max_samples=150", "--quiet"])
    assert quiet.exit_code == 0 and quiet.stderr.startswith("warning: the training split differs")  # not progress


def test_resuming_a_run_at_its_step_limit_trains_no_further(tmp_path):
    path = write_config(tmp_path / "done.yaml", train={"max_steps": 3})
    train(load_config(path), tmp_path / "run")
    before = _weights(tmp_path / "run")
    config, run_dir = prepare_run(None, tmp_path / "run", [], None)
    result = train(config, run_dir, resume=True)
    assert result.state.step == 3 and result.stop_reason == "reached train.max_steps 3"
    assert [p.name for p in step_checkpoints(run_dir)] == ["step-00000003"]
    assert all(torch.equal(before[name], tensor) for name, tensor in _weights(run_dir).items())


def test_a_write_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    import tformer_cli.runtime as runtime

    path = write_config(tmp_path / "k.yaml", train={"max_steps": 2, "eval_every": 2})
    run_dir = tmp_path / "run"
    train(load_config(path), run_dir)
    good = step_checkpoints(run_dir)[-1]

    def crash(*args, **kwargs):
        raise OSError("disk unplugged")

    monkeypatch.setattr(runtime.torch, "save", crash)  # dies after the weights, before the trainer state
    config, _ = prepare_run(None, run_dir, ["train.max_steps=4"], None)
    with pytest.raises(CheckpointError, match=r"disk unplugged\); nothing was replaced.*step-00000002, is intact"):
        train(config, run_dir, resume=True)
    monkeypatch.undo()
    assert step_checkpoints(run_dir) == [good]
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))  # no half-written folder left behind
    assert load_config(run_dir / "config.yaml").train.max_steps == 2  # no checkpoint was made under the override
    loaded = load_run(run_dir)  # eval/generate still find complete weights
    assert loaded.weights == run_dir / "model.safetensors"
    config, _ = prepare_run(None, run_dir, ["train.max_steps=4"], None)
    assert train(config, run_dir, resume=True).state.step == 4


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_midway_through_a_step_stops_after_it_and_the_resume_is_exact(tmp_path, monkeypatch, signum):
    import tformer_cli.train as training
    from safetensors.torch import load_file

    path = write_config(tmp_path / "c.yaml", train={"max_steps": 8})  # dropout draws random numbers every step
    train(load_config(path), tmp_path / "straight")

    def signal_in_step_4(step, *args):  # after its forward and backward: its dropout masks were drawn
        if step == 4:
            os.kill(os.getpid(), signum)
        return learning_rate(step, *args)

    monkeypatch.setattr(training, "learning_rate", signal_in_step_4)
    result = train(load_config(path), tmp_path / "run")
    monkeypatch.undo()
    assert result.stop_reason == "interrupted" and result.signal == signum
    assert [p.name for p in step_checkpoints(tmp_path / "run")] == ["step-00000004"]
    config, run_dir = prepare_run(None, tmp_path / "run", [], None)
    assert train(config, run_dir, resume=True).state.step == 8
    resumed, straight = (load_file(str(folder / "model.safetensors")) for folder in (run_dir, tmp_path / "straight"))
    assert all(torch.equal(resumed[name], straight[name]) for name in straight)


def test_stopping_by_epochs_and_time(tmp_path):
    path = write_config(tmp_path / "e.yaml", train={"max_steps": None, "epochs": 1})
    result = train(load_config(path), tmp_path / "run")
    assert result.stop_reason == "reached train.epochs 1" and result.state.epoch == 1
    timed = write_config(tmp_path / "t.yaml", train={"max_steps": None, "max_time": 0.5})
    assert "max_time" in train(load_config(timed), tmp_path / "run2").stop_reason


def test_early_stopping_on_the_validation_metric(tmp_path):
    # Adam at lr 1 makes validation worse (at 50 the weights turned NaN, which now stops the run as diverged)
    path = write_config(tmp_path / "p.yaml", train={"max_steps": 200, "eval_every": 1, "patience": 2,
                                                    "lr": 1.0, "eval_bleu": False, "clip_grad_norm": None},
                        data={"max_samples": 60})
    result = train(load_config(path), tmp_path / "run")
    assert "early stopping" in result.stop_reason
    assert result.state.evals_without_improvement == 2


@pytest.mark.parametrize("native", [True, False])
def test_bf16_autocast_trains_on_cpu_and_warns_where_it_would_be_slow(tmp_path, monkeypatch, native):
    monkeypatch.setattr("tformer_cli.accel.ops.native_on_cpu", lambda precision: native)
    path = write_config(tmp_path / "b.yaml", train={"max_steps": 3, "precision": "bf16", "device": "cpu"})
    events = []
    result = train(load_config(path), tmp_path / "run", callback=lambda event, data: events.append((event, data)))
    assert result.state.step == 3
    losses = [data["loss"] for event, data in events if event == "step"]
    assert losses and all(math.isfinite(loss) for loss in losses)
    warnings = [data["message"] for event, data in events if event == "warning"]
    assert (warnings == []) if native else ("set train.precision=fp32" in warnings[0])


def test_validation_computes_in_the_precision_training_computes_in(tmp_path, monkeypatch):
    """A run that trains under bf16 autocast validates under it too (as fairseq validates an fp16 run):
    the logged validation loss is evaluate_loss's under bf16 autocast, not its fp32 figure."""
    import tformer_cli.run_setup as run_setup
    from tformer_cli.evaluation import evaluate_loss

    references, record = {}, run_setup.validation_record

    def validation_record(model, vocab, split, train_cfg, *args, **kwargs):
        for name, enabled in (("bf16", True), ("fp32", False)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                references[name] = evaluate_loss(model, split, train_cfg.max_tokens).loss
        return record(model, vocab, split, train_cfg, *args, **kwargs)

    monkeypatch.setattr(run_setup, "validation_record", validation_record)
    path = write_config(tmp_path / "b.yaml", train={"max_steps": 2, "eval_every": 2, "precision": "bf16"})
    logged = train(load_config(path), tmp_path / "run").last_eval["loss"]
    assert logged == pytest.approx(references["bf16"], rel=1e-6)
    assert references["fp32"] != pytest.approx(references["bf16"], rel=1e-5)  # which the fp32 figure is not


def test_precision_auto_is_bf16_on_a_gpu_with_bf16_tensor_cores_and_fp32_elsewhere_for_training_and_decoding(tmp_path, monkeypatch):
    from tformer_cli.devices import resolve_precision

    capability = {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["of the GPU"])
    cuda = torch.device("cuda")
    for capability["of the GPU"], expected in (((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "fp32")):  # H100, A100, T4
        assert resolve_precision("auto", cuda) == expected
        assert resolve_precision("fp32", cuda) == "fp32"  # what is asked for, as it is
    assert [resolve_precision(setting, cuda) for setting in ("fp32", "bf16", "fp16")] == ["fp32", "bf16", "fp16"]
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == "fp32" and resolve_precision("int8", cpu) == "int8"  # eval's int8
    # a CPU trains in fp32 unless bf16 is asked for, whatever it has: the default config here
    events = []
    train(load_config(write_config(tmp_path / "a.yaml", train={"max_steps": 1, "device": "cpu"})), tmp_path / "run",
          callback=lambda event, data: events.append((event, data)))
    assert [data["precision"] for event, data in events if event == "start"] == ["fp32"]


def test_auto_precision_on_a_gpu_with_fp16_tensor_cores_alone_says_fp16_would_be_faster(tmp_path, monkeypatch, capsys):
    """A V100 or T4 (compute capability 7.x) has fp16 tensor cores but none for bf16, so auto stays in
    fp32 there, as fairseq and the Hugging Face Trainer do without --fp16; training and decoding say
    that fp16 would be faster, and what is asked for explicitly (fp32 included) is not second-guessed."""
    import tformer_cli.train_plan as train_plan
    from tformer_cli.cli_options import decoding_precision
    from tformer_cli.devices import fp16_would_be_faster

    capability = {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["of the GPU"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    cuda = torch.device("cuda")
    for capability["of the GPU"], hinted in (((7, 0), True), ((7, 5), True), ((8, 0), False), ((9, 0), False),
                                              ((6, 0), False)):  # V100, T4, A100, H100, P100 (no tensor cores)
        assert (fp16_would_be_faster("auto", cuda) is not None) == hinted
        assert [fp16_would_be_faster(setting, cuda) for setting in ("fp32", "bf16", "fp16")] == [None] * 3
    capability["of the GPU"] = (7, 0)
    assert fp16_would_be_faster("auto", cuda) == (
        "auto is fp32 on Tesla V100-SXM2-16GB, which has fp16 tensor cores but none for bf16 (compute "
        "capability 7.0); in fp16 its matrix products run about 8x faster")
    assert fp16_would_be_faster("auto", torch.device("cpu")) is None

    assert decoding_precision("auto", cuda) == "fp32"  # eval and generate: resolved as before, with the hint
    assert capsys.readouterr().err.replace("\n", " ").startswith(
        "warning: --precision auto is fp32 on Tesla V100-SXM2-16GB")
    assert decoding_precision("fp32", cuda) == "fp32" and capsys.readouterr().err == ""

    # training: the hint is a warning of the run's start (here on the CPU, standing in for the V100)
    monkeypatch.setattr(train_plan, "fp16_would_be_faster",
                        lambda setting, device: fp16_would_be_faster(setting, cuda))
    for precision, warned in (("auto", True), ("fp32", False)):
        events = []
        path = write_config(tmp_path / f"{precision}.yaml", train={"max_steps": 1, "device": "cpu",
                                                                   "precision": precision})
        train(load_config(path), tmp_path / precision, callback=lambda event, data: events.append((event, data)))
        warnings = [data["message"] for event, data in events if event == "warning"]
        assert warnings == ([f"train.precision {fp16_would_be_faster('auto', cuda)}: set train.precision=fp16 (or "
                             "fp32, which trains as now without this warning)"] if warned else [])


def test_bpe_dropout_resegments_the_training_split_every_epoch(tmp_path, monkeypatch):
    import tformer_cli.segmentation as segmentation

    draw, drawn = segmentation.resegment, []
    monkeypatch.setattr(segmentation, "resegment", lambda *args: drawn.append(draw(*args)) or drawn[-1])
    path = write_config(tmp_path / "b.yaml", train={"max_steps": None, "epochs": 2},
                        data={"bpe_dropout": 0.3, "max_samples": 60})
    events = []
    result = train(load_config(path), tmp_path / "run", callback=lambda e, d: events.append((e, d)))
    assert result.state.epoch == 2 and len(drawn) == 2
    assert drawn[0].pairs == drawn[1].pairs and drawn[0].tgt != drawn[1].tgt
    start = next(d for e, d in events if e == "start")  # epoch length from the segmentation trained on
    assert start["steps_per_epoch"] == len(token_batches([len(s) for s in drawn[0].src],
                                                         [len(t) for t in drawn[0].tgt], 600,
                                                         multiple=load_config(path).train.batch_multiple))


@pytest.mark.parametrize("ahead", [False, True], ids=["drawn-at-each-epoch", "drawn-while-the-epoch-before-trains"])
def test_bpe_dropout_a_resumed_run_goes_on_over_the_segmentation_it_stopped_in(tmp_path, monkeypatch, ahead):
    """tokenizers' BPE-dropout takes no seed, so a draw cannot be made again: each epoch's is kept with its
    checkpoints (one file, linked), and a run stopped mid-epoch resumes over it. The test hands out
    real draws in order: a run that drew its epoch again on resuming would train on the next one's."""
    import tformer_cli.run_setup as run_setup
    import tformer_cli.segmentation as segmentation
    from tformer_cli.encoding import read_encoded
    from tformer_cli.run_folder import SEGMENTATION, foreign_files

    draw = segmentation.resegment
    monkeypatch.setattr(run_setup, "draws_ahead", lambda device: ahead)  # as on a GPU: on a thread, an epoch ahead
    path = write_config(tmp_path / "b.yaml", train={"max_steps": None, "epochs": 3, "save_every": 2, "keep_last": 20},
                        data={"bpe_dropout": 0.3, "max_samples": 120})
    draws = []
    monkeypatch.setattr(segmentation, "resegment", lambda *args: draws.append(draw(*args)) or draws[-1])
    events = []
    straight = train(load_config(path), tmp_path / "straight", callback=lambda e, d: events.append((e, d)))
    assert len(draws) == 3 + ahead  # drawn ahead: one more, for an epoch that never came
    epoch_of = {d["step"]: d["epoch"] for e, d in events if e == "step"}
    checkpoints = step_checkpoints(tmp_path / "straight")
    epochs = [epoch_of[int(c.name[5:])] for c in checkpoints]
    assert len(set(epochs)) == 3
    for checkpoint, epoch in zip(checkpoints, epochs):  # each holds its epoch's draw: one file an epoch, linked
        assert read_encoded(checkpoint / SEGMENTATION).tgt == draws[epoch].tgt
        assert (checkpoint / SEGMENTATION).stat().st_nlink == epochs.count(epoch)
    assert not foreign_files(tmp_path / "straight")  # tformer's own files: --overwrite and keep_last remove them
    replay = iter(draws)
    monkeypatch.setattr(segmentation, "resegment", lambda *args: next(replay))
    second_epoch = [step for step, epoch in epoch_of.items() if epoch == 1]
    assert len(second_epoch) >= 3  # stopped in the middle of it
    train(load_config(path, [f"train.max_steps={second_epoch[1]}", "train.save_every=1000"]), tmp_path / "resumed")
    # resumed, it draws from epoch 2 on (a run that drew its epoch again would train on epoch 2's draw)
    monkeypatch.setattr(segmentation, "resegment", lambda *args, later=iter(draws[2:]): next(later))
    config, run_dir = prepare_run(None, tmp_path / "resumed", ["train.max_steps=null"], None)
    assert train(config, run_dir, resume=True).state.step == straight.state.step
    ours, theirs = _weights(tmp_path / "straight"), _weights(run_dir)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_checkpoint_without_its_bpe_dropout_segmentation_resumes_with_a_warning_or_one_line(tmp_path, damage):
    from tformer_cli.run_folder import SEGMENTATION

    path = write_config(tmp_path / "b.yaml", train={"max_steps": 3}, data={"bpe_dropout": 0.3, "max_samples": 120})
    train(load_config(path), tmp_path / "run")
    stored = step_checkpoints(tmp_path / "run")[-1] / SEGMENTATION
    if damage == "missing":  # as a checkpoint from before tformer kept them
        stored.unlink()
    else:
        stored.write_bytes(stored.read_bytes()[:100])
    config, run_dir = prepare_run(None, tmp_path / "run", ["train.max_steps=5"], None)
    events = []
    if damage == "corrupt":
        with pytest.raises(CheckpointError, match=rf"{SEGMENTATION}: unreadable segmentation .*; resume from an "
                                                  "earlier checkpoint by deleting this one"):
            train(config, run_dir, resume=True)
        return
    assert train(config, run_dir, resume=True, callback=lambda e, d: events.append((e, d))).state.step == 5
    assert [d["message"] for e, d in events if e == "warning"] == [
        "step-00000003 holds no BPE-dropout segmentation of its epoch: the rest of the epoch is segmented afresh, so "
        "the run will not match one that was never stopped"]


def test_under_bpe_dropout_each_process_draws_its_share_and_all_train_on_the_shares_joined(tmp_path, monkeypatch):
    """Of two processes, the second draws the second half of the pairs and trains on both halves, in
    order: its own and rank 0's, whose tensors reach it as they are (``Workers.tensors_from_each``;
    test_parallel sends them between two processes)."""
    import tformer_cli.segmentation as segmentation
    from tformer_cli.encoding import EncodedSplit

    rank_0s = EncodedSplit([[5, 2]], [[1, 6, 2]], [("a", "b")], dropped_long=3)
    ours = EncodedSplit([[7, 8, 2]], [[1, 9, 2]], [("c d", "e")], truncated=1)
    shares = []

    class Rank1(Workers):  # what reaches it: copies of each process's tensors, counts and all
        def tensors_from_each(self, tensors):
            return [{name: t.clone() for name, t in segmentation._share_tensors(rank_0s).items()}, tensors]

    monkeypatch.setattr(segmentation, "resegment", lambda data, vocab, cfg, share: shares.append(share) or ours)
    drawn = segmentation.Segmentations(None, None, None, Rank1(1, 2), ahead=True)
    for epoch in (0, 1):
        assert drawn.of_epoch(epoch).split == EncodedSplit([[5, 2], [7, 8, 2]], [[1, 6, 2], [1, 9, 2]],
                                                           [("a", "b"), ("c d", "e")], dropped_long=3, truncated=1)
    assert shares == [(1, 2)] * 3  # epochs 0 and 1, and epoch 2's drawn ahead


@pytest.mark.parametrize("fails", [False, True])
def test_a_draw_beside_training_runs_with_the_heap_frozen_and_leaves_the_collector_as_it_was(fails):
    """While BPE-dropout draws on its thread, what existed before is frozen out of the collector's full
    collections (which would hold the GIL ~0.1 s each and stall training); afterwards, also after a
    draw that failed, nothing stays frozen."""
    import gc

    from tformer_cli.segmentation import _Drawing

    frozen = []

    def draw():
        frozen.append(gc.get_freeze_count())
        if fails:
            raise ValueError("no draw")
        return "the split"

    before = gc.get_freeze_count()
    drawing = _Drawing(draw)
    if fails:
        with pytest.raises(ValueError, match="no draw"):
            drawing.result()
    else:
        assert drawing.result() == "the split"
    assert frozen[0] > before and gc.get_freeze_count() == before


@pytest.mark.parametrize("eval_every", [1000, 3], ids=["caught-by-the-checkpoint", "caught-by-validation"])
def test_a_diverged_run_stops_before_saving_and_keeps_its_good_checkpoints(tmp_path, monkeypatch, eval_every):
    import tformer_cli.train as training
    from safetensors.torch import load_file

    from tformer_cli.errors import DivergedError

    poisoned = []

    def nan_rate_in_step_3(step, *args):  # once: the third step's update turns the weights NaN
        if step == 3 and not poisoned:
            poisoned.append(step)
            return float("nan")
        return learning_rate(step, *args)

    monkeypatch.setattr(training, "learning_rate", nan_rate_in_step_3)
    path = write_config(tmp_path / "d.yaml", train={"max_steps": 6, "save_every": 1, "log_every": 2,
                                                    "clip_grad_norm": None, "eval_every": eval_every,
                                                    "eval_bleu": False})
    with pytest.raises(DivergedError, match="training diverged at step 3: the weights are no longer finite; "
                                            "the checkpoints saved before are kept"):
        train(load_config(path), tmp_path / "run")  # step 3 is no log step: the checkpoint refuses to save it
    saved = step_checkpoints(tmp_path / "run")
    assert [c.name for c in saved] == ["step-00000001", "step-00000002"]
    assert all(t.isfinite().all() for t in load_file(str(saved[-1] / "model.safetensors")).values())
    assert not (tmp_path / "run" / "model.safetensors").exists()  # a first validation of NaN weights: no "best"
    resumed = train(load_config(tmp_path / "run" / "config.yaml", saved_run=True), tmp_path / "run", resume=True)
    assert resumed.state.step == 6  # the run goes on from step 2 (the poisoned update is behind it)


def test_fp16_loss_scale_is_kept_across_a_resume(tmp_path):
    from tformer_cli.run_folder import TRAINER

    path = write_config(tmp_path / "f.yaml", train={"max_steps": 2, "save_every": 2, "precision": "fp16"})
    train(load_config(path), tmp_path / "run")
    checkpoint = step_checkpoints(tmp_path / "run")[-1] / TRAINER
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["scaler"]["scale"] == 65536.0  # the initial scale: no overflow, no growth in 2 steps
    saved["scaler"]["scale"] = 1024.0  # as if overflows had lowered it
    torch.save(saved, checkpoint)
    train(load_config(tmp_path / "run" / "config.yaml", ["train.max_steps=4"], saved_run=True), tmp_path / "run",
          resume=True)
    resumed = torch.load(step_checkpoints(tmp_path / "run")[-1] / TRAINER, weights_only=True)
    assert resumed["state"]["step"] == 4 and resumed["scaler"]["scale"] == 1024.0  # not reset to 65536


def test_a_run_on_data_not_yet_cached_reads_and_tokenises_it_in_a_child_process(tmp_path, monkeypatch):
    """Reading and tokenising leave libraries and heap behind (preparing.prepare_apart): a run whose data is
    not cached has a child process fill the cache, then trains from it. Here reading fails; the run
    does not, and a second run finds everything cached."""
    import tformer_cli.encoding as encoding
    import tformer_cli.preparing as preparing

    def read_here(*args):
        raise AssertionError("the training process read the data")

    monkeypatch.setattr(encoding, "read_pairs", read_here)
    monkeypatch.setattr(preparing, "PREPARE_APART_FROM", 100)  # so that tiny data is prepared apart too
    path = write_config(tmp_path / "c.yaml", data={"max_samples": 137}, train={"max_steps": 2})  # not yet cached
    for run, prepared in (("first", True), ("second", False)):
        events = []
        result = train(load_config(path), tmp_path / run, callback=lambda event, data: events.append((event, data)))
        assert result.state.step == 2
        setup = [data["message"] for event, data in events if event == "setup"]
        assert setup == (["learning the BPE vocabulary and tokenising"] if prepared else [])


def test_a_run_that_validates_by_decoding_builds_decodings_kernels_before_training(tmp_path, monkeypatch):
    """Validation's decoding kernels are compiled before the first step (linear.build_decoding_kernels),
    for the most hypotheses its greedy batches hold: the validation sentences, up to the batch size."""
    from tformer_cli import kernel_warmup

    calls = []
    monkeypatch.setattr(kernel_warmup, "build_decoding_kernels",
                        lambda model, rows: calls.append((type(model).__name__, rows)))
    for name, train_cfg, decode in (("bleu", {}, {}), ("batch", {}, {"batch_size": 8}),
                                    ("loss only", {"eval_bleu": False, "best_metric": "loss"}, {})):
        path = write_config(tmp_path / f"{name}.yaml", train={"max_steps": 1, **train_cfg}, decode=decode)
        train(load_config(path), tmp_path / name)
    assert calls == [("Transformer", 20), ("Transformer", 8)]  # eval_max_sentences: 20; none without BLEU


def test_with_products_on_onednn_a_run_compiles_no_kernel_after_its_build(tmp_path, monkeypatch, capfd):
    """The build's passes cover the epoch's steps and validation (its loss and its decoding), and
    decoding's row counts are built too: nothing is left to compile among the steps' buffers. Read
    from oneDNN's verbose log, after a mark that the build writes when it ends."""
    from tformer_cli import kernel_warmup
    from tformer_cli.accel import gemm, linear

    if gemm.LINEAR_POINTWISE is None or not linear.PACKING:
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(gemm, "pays_here", lambda: True)
    monkeypatch.setattr(gemm, "MIN_PRODUCT", 0)
    build = kernel_warmup.build_kernels

    def build_then_mark(passes):
        built = build(passes)
        os.write(1, b"BUILT\n")  # where the log of what training compiles after its build starts
        return built

    monkeypatch.setattr(kernel_warmup, "build_kernels", build_then_mark)
    # d_model 24: shapes of this test's own, so that no kernel an earlier test compiled can stand in
    path = write_config(tmp_path / "v.yaml", model={"d_model": 24, "d_ff": 40},
                        train={"max_steps": 4, "eval_every": 2})
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
        train(load_config(path), tmp_path / "run")
    gemm.enable(False)
    log = capfd.readouterr().out
    assert "BUILT" in log
    before, after = log.split("BUILT", 1)
    compiled = [line for line in after.splitlines()
                if "cache_miss" in line and ("inner_product" in line or "matmul" in line)]
    assert "cache_miss" in before and compiled == [], compiled[:3]


def test_building_the_kernels_before_training_changes_no_step(tmp_path, monkeypatch):
    """With products on oneDNN, training first compiles their kernels with a pass per batch shape
    (gemm.build_kernels): the run takes the steps a run without those passes takes."""
    from tformer_cli import kernel_warmup
    from tformer_cli.accel import gemm

    if gemm.LINEAR_POINTWISE is None:
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(gemm, "pays_here", lambda: True)
    monkeypatch.setattr(gemm, "MIN_PRODUCT", 0)
    path = write_config(tmp_path / "k.yaml", train={"max_steps": 4, "log_every": 1, "eval_every": 1000})
    built, losses = [], {}
    build = kernel_warmup.build_kernels
    for first in (True, False):
        monkeypatch.setattr(kernel_warmup, "build_kernels", lambda passes: built.append(build(passes)) if first else 0)
        events = []
        train(load_config(path), tmp_path / str(first), callback=lambda event, data: events.append((event, data)))
        losses[first] = [data["loss"] for event, data in events if event == "step"]
    gemm.enable(False)
    assert built[0] > 10 and len(losses[True]) == 4
    assert losses[True] == losses[False]
    built_first, lazily = _weights(tmp_path / "True"), _weights(tmp_path / "False")
    assert all(torch.equal(built_first[name], lazily[name]) for name in lazily)


@pytest.mark.slow  # torch.compile: ~30 s
def test_train_compile_gives_the_eager_runs_losses(tmp_path):
    """train.compile compiles the model's forward and backward (the fused loss stays eager) and trains the
    same model: without dropout, whose compiled masks are drawn differently, the losses agree."""
    losses = {}
    for compiled in (False, True):
        path = write_config(tmp_path / f"{compiled}.yaml", model={"dropout": 0.0},
                            train={"compile": compiled, "accel": "off", "max_steps": 5})
        events = []
        train(load_config(path), tmp_path / f"run-{compiled}", callback=lambda e, d: events.append((e, d)))
        losses[compiled] = [d["loss"] for e, d in events if e == "step"]
    assert len(losses[True]) == 5
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=1e-5)

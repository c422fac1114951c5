from pathlib import Path

import pytest
import torch

from conftest import tiny_model_config
from tformer_cli.errors import CheckpointError, UsageError
from tformer_cli.model import build_model
from tformer_cli.run_folder import step_checkpoints
from tformer_cli.runtime import (
    average_checkpoints, load_run, load_run_config, load_weights, save_checkpoint, save_weights, skipping_random_init)


def test_averaging_two_checkpoints_gives_the_element_wise_mean(tmp_path):
    models = [build_model(tiny_model_config(), 30) for _ in range(2)]
    for step, model in enumerate(models, start=1):
        save_checkpoint(tmp_path, step, model, {"state": {}}, keep_last=5)
    (tmp_path / "config.yaml").write_text("model: {}\n")  # the run folder's files, copied beside an average outside it
    (tmp_path / "tokenizer.json").write_text("{}")
    folder = average_checkpoints(step_checkpoints(tmp_path), tmp_path / "checkpoints" / "average-2", tmp_path)
    averaged = build_model(tiny_model_config(), 30)
    load_weights(averaged, folder / "model.safetensors")
    for (name, a), b, c in zip(averaged.state_dict().items(), models[0].state_dict().values(),
                               models[1].state_dict().values()):
        torch.testing.assert_close(a, (b + c) / 2, msg=name)
    assert averaged.output_proj.weight is averaged.encoder.embed.embedding.weight  # still tied
    assert not (folder / "config.yaml").exists()  # inside the run: eval and generate find the run's config above it
    assert average_checkpoints(step_checkpoints(tmp_path)[:1], folder, tmp_path) == folder  # an average may be replaced
    checkpoint = step_checkpoints(tmp_path)[0]
    weights = (checkpoint / "model.safetensors").read_bytes()
    with pytest.raises(UsageError, match="holds a model.safetensors that is not an average"):
        average_checkpoints(step_checkpoints(tmp_path), checkpoint, tmp_path)
    assert (checkpoint / "model.safetensors").read_bytes() == weights
    for mine in (b"keep", b""):  # a file of the user's that is no safetensors at all
        (tmp_path / "elsewhere").mkdir(exist_ok=True)
        (tmp_path / "elsewhere" / "model.safetensors").write_bytes(mine)
        with pytest.raises(UsageError, match="holds a model.safetensors that is not an average"):
            average_checkpoints(step_checkpoints(tmp_path), tmp_path / "elsewhere", tmp_path)
        assert (tmp_path / "elsewhere" / "model.safetensors").read_bytes() == mine


def test_keep_last_prunes_old_checkpoints_and_weights_round_trip(tmp_path):
    model = build_model(tiny_model_config(), 30)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, {"state": {}}, keep_last=2)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000004", "step-00000005"]
    # pruning deletes the checkpoint's own files, not a user's file beside them
    (tmp_path / "checkpoints" / "step-00000004" / "hyps.txt").write_text("mine\n")
    save_checkpoint(tmp_path, 6, model, {"state": {}}, keep_last=2)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-00000005", "step-00000006"]
    assert [p.name for p in (tmp_path / "checkpoints" / "step-00000004").iterdir()] == ["hyps.txt"]
    # a checkpoint that is a link someone made is left alone, as is what it points to
    elsewhere = tmp_path / "elsewhere"
    (tmp_path / "checkpoints" / "step-00000005").rename(elsewhere)
    (tmp_path / "checkpoints" / "step-00000005").symlink_to(elsewhere)
    save_checkpoint(tmp_path, 7, model, {"state": {}}, keep_last=2)
    assert (elsewhere / "model.safetensors").is_file() and (tmp_path / "checkpoints" / "step-00000005").is_symlink()
    # so does writing a checkpoint again over one of the same step
    (tmp_path / "checkpoints" / "step-00000006" / "notes.txt").write_text("mine too\n")
    save_checkpoint(tmp_path, 6, model, {"state": {"again": torch.ones(1)}}, keep_last=2)
    assert (tmp_path / "checkpoints" / "step-00000006" / "notes.txt").read_text() == "mine too\n"
    assert "again" in torch.load(tmp_path / "checkpoints" / "step-00000006" / "trainer.pt")["state"]
    save_weights(model, tmp_path / "w.safetensors")
    again = build_model(tiny_model_config(), 30)
    load_weights(again, tmp_path / "w.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    other = build_model(tiny_model_config(d_model=16), 30)
    with pytest.raises(CheckpointError, match="unreadable weights|do not fit"):
        load_weights(other, tmp_path / "w.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="bad.safetensors: unreadable weights"):
        load_weights(again, tmp_path / "bad.safetensors")


def test_a_run_saved_before_attention_bias_existed_loads_with_biases(trained_run, tmp_path):
    import shutil

    import yaml

    run = shutil.copytree(trained_run, tmp_path / "old")
    raw = yaml.safe_load((run / "config.yaml").read_text())
    assert raw["model"].pop("attention_bias") is False  # new runs have the paper's plain projections
    (run / "config.yaml").write_text(yaml.safe_dump(raw))
    config = load_run_config(run)
    assert config.model.attention_bias
    loaded = load_run(trained_run)
    biased = build_model(config.model, loaded.vocab.src_size, loaded.vocab.tgt_size)
    save_weights(biased, run / "model.safetensors")
    model = load_run(run).model
    assert model.decoder.layers[0].cross_attn.kv_proj.bias is not None
    for (name, ours), theirs in zip(model.state_dict().items(), biased.state_dict().values()):
        torch.testing.assert_close(ours, theirs, msg=name)


def test_loading_a_run_draws_no_weights_only_to_overwrite_them(trained_run):
    from safetensors.torch import load_file

    before = torch.get_rng_state()
    model = load_run(trained_run, accel="off").model
    assert torch.equal(torch.get_rng_state(), before)  # nothing drawn
    state = model.state_dict()
    for name, stored in load_file(trained_run / "model.safetensors").items():
        assert torch.equal(state[name], stored), name
    assert model.output_proj.weight is model.decoder.embed.embedding.weight  # ties kept
    # what is computed rather than drawn (the positional tables) is built as usual
    config = tiny_model_config(positional="rope")
    with skipping_random_init():
        skipped = build_model(config, 30)
    plain = build_model(config, 30)
    for (name, ours), theirs in zip(skipped.named_buffers(), plain.buffers()):
        assert torch.equal(ours, theirs), name


class _Payload:
    """Unpickling it would create a file: what a booby-trapped trainer.pt could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_resuming_reads_trainer_state_without_running_code_from_it(tmp_path):
    from tformer_cli.runtime import load_trainer_state

    checkpoint = tmp_path / "step-00000001"
    checkpoint.mkdir()
    marker = tmp_path / "code-ran"
    torch.save({"optimizer": {}, "state": {}, "rng": _Payload(marker)}, checkpoint / "trainer.pt")
    with pytest.raises(CheckpointError, match="unreadable trainer state .*resume from an earlier checkpoint"):
        load_trainer_state(checkpoint)
    assert not marker.exists()
    torch.save({"optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}, "state": {"step": 1},
                "rng": {"python": (3, (1, 2), None), "torch": torch.get_rng_state()}}, checkpoint / "trainer.pt")
    assert load_trainer_state(checkpoint)["state"] == {"step": 1}


def test_matmul_peak_leaves_the_runs_random_numbers_alone():
    """Measured at a run's start: drawing its matrices from the global generator would change the run."""
    from tformer_cli.devices import matmul_peak

    matmul_peak.cache_clear()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert matmul_peak(torch.device("cpu"), "fp32") > 1e8  # FLOP/s: any CPU does more than 0.1 GFLOP/s
    assert torch.equal(torch.rand(3), expected)


def test_resident_memory_and_its_peak_since_a_reset():
    import mmap
    import os

    from tformer_cli.devices import memory_mib, reset_peak_memory, resident_mib

    if resident_mib() is None:
        pytest.skip("no /proc: not Linux")
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    size = 256 * 2**20
    block = mmap.mmap(-1, size)  # memory of its own, given back on close whatever malloc keeps
    for offset in range(0, size, os.sysconf("SC_PAGE_SIZE")):
        block[offset] = 1  # resident once touched
    held = memory_mib(cpu)["rss_mib"]
    block.close()
    assert held > memory_mib(cpu)["rss_mib"] + 200  # resident now: the block is gone
    peak = resident_mib(peak=True)
    assert peak > held - 4  # the peak saw it (the kernel's counters lag by a few pages)
    reset_peak_memory(cpu)
    assert resident_mib(peak=True) < peak - 200  # afresh: the block was before

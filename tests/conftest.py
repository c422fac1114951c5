import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# datasets reads its cache folder once, when imported: the tables of the tests' data go to a temporary
# folder (removed at the end), not the user's ~/.cache/huggingface/datasets
HF_DATASETS_CACHE = os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="tformer-tests-datasets-")
# two threads a test (tiny models gain nothing from more), and no more than the cores shared among the
# processes that `make test` runs the suite in (pytest-xdist's workers)
torch.set_num_threads(max(1, min(2, torch.get_num_threads() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)))))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _cache(tmp_path_factory):
    """Tokenizer and encoding caches go to a temporary folder, not the user's home."""
    os.environ["TFORMER_CACHE"] = str(tmp_path_factory.mktemp("tformer-cache"))
    yield
    shutil.rmtree(HF_DATASETS_CACHE, ignore_errors=True)


def readme_blocks(language: str) -> list[str]:
    """The README's fenced code blocks in ``language`` (bash, console, python), as text."""
    import re
    from pathlib import Path

    readme = Path(__file__).resolve().parent.parent / "README.md"
    return re.findall(rf"```{language}\n(.*?)```", readme.read_text(), re.S)


def write_config(path, **sections):
    """A tiny training config on the bundled demo data, with section overrides: write_config(p, train={...})."""
    import yaml

    config = {
        "model": {"d_model": 32, "num_heads": 4, "num_encoder_layers": 1, "num_decoder_layers": 1, "d_ff": 64,
                  "dropout": 0.1, "max_len": 64},
        "data": {"dataset": "data/numbers", "source": "en", "target": "de", "max_length": 48, "vocab_size": 200,
                 "min_frequency": 1, "max_samples": 300},
        "train": {"max_tokens": 600, "schedule": "constant", "lr": 3e-3, "warmup_steps": 0, "max_steps": 6,
                  "log_every": 1, "eval_every": 1000, "eval_max_sentences": 20, "seed": 3, "device": "cpu"},
        "decode": {"max_len_a": 2.5, "max_len_b": 10},
    }
    for name, values in sections.items():
        config[name].update(values)
    path.write_text(yaml.safe_dump(config))
    return path


def parallel_config(path):
    """A tiny config for several processes: no dropout, and 4 steps within the first epoch (whose last odd
    batch two processes leave out)."""
    return write_config(path, model={"dropout": 0.0}, data={"max_samples": 800},
                        train={"max_steps": 4, "eval_every": 2, "save_every": 2, "log_every": 2})


def tiny_model_config(**overrides):
    """A model small enough for a unit test, overridable per test."""
    from tformer_cli.config import ModelConfig

    values = dict(d_model=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=64, dropout=0.0,
                  max_len=64)
    values.update(overrides)
    return ModelConfig(**values)


def tiny_batch(vocab: int = 40):
    """Three random pairs of 6 tokens, the second target padded after 4: a training ``Batch``."""
    from tformer_cli.batching import Batch

    src, tgt = torch.randint(4, vocab, (3, 6)), torch.randint(4, vocab, (3, 6))
    tgt[1, 4:] = 0
    return Batch(src, tgt[:, :-1], tgt[:, 1:], [0, 1, 2])


def train_step(model, model_config, device="cpu", **train):
    """``tformer train``'s own optimizer step (``train._step``) for ``model``, set up as training sets it
    up (the objective module, ``make_optimizer``, the gradient scaler, one process) but without data or
    a run folder: a function of one host ``Batch`` that steps and counts the step, as the loop does."""
    from types import SimpleNamespace

    import tformer_cli.train as training
    from tformer_cli.config import Config, TrainConfig
    from tformer_cli.devices import autocast, resolve_precision
    from tformer_cli.evaluation import Seq2SeqLoss
    from tformer_cli.optim import make_optimizer
    from tformer_cli.parallel import Workers
    from tformer_cli.run_setup import TrainState

    device, cfg = torch.device(device), TrainConfig(**train)
    precision = resolve_precision(cfg.precision, device)
    setup = SimpleNamespace(config=Config(model=model_config, train=cfg), workers=Workers(), state=TrainState(),
                            optimizer=make_optimizer(model, cfg, device), device=device, model=model, ema=None,
                            scaler=torch.amp.GradScaler(device.type, enabled=precision == "fp16"),
                            trainer=Seq2SeqLoss(model, cfg.label_smoothing, cfg.rdrop).train())

    def step(batch):
        training._step(setup, [batch], batch.num_tokens, None, autocast(device, precision))
        setup.state.step += 1

    return step


@pytest.fixture
def compilable_gpu(monkeypatch):
    """torch.cuda answering as an A100's would, with Triton installed (the CPU wheel has neither): for
    code that asks whether torch.compile compiles for the GPU, run without one."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: True if name == "triton" else find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, _cache):
    """A tiny run trained once through the CLI, for the tests of eval, generate and inspect-attention."""
    from typer.testing import CliRunner

    from tformer_cli.cli import app

    folder = tmp_path_factory.mktemp("cli")
    config = write_config(folder / "tiny.yaml", train={"max_steps": 30, "eval_every": 15, "eval_max_sentences": 10},
                          data={"max_samples": 400})
    result = CliRunner().invoke(app, ["train", str(config), "--output-dir", str(folder / "run"), "--quiet"])
    assert result.exit_code == 0, result.output
    return folder / "run"


def copy_attention_into(ours, reference) -> None:
    """Copy our MultiHeadAttention's weights into an nn.MultiheadAttention (fused in_proj layout); where
    ours has no biases, the reference's are zeroed."""
    projections = [ours.q_proj, ours.kv_proj] if ours.cross else [ours.qkv_proj]
    with torch.no_grad():
        reference.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))
        reference.out_proj.weight.copy_(ours.out_proj.weight)
        for theirs, mine in ((reference.in_proj_bias, projections), (reference.out_proj.bias, [ours.out_proj])):
            if theirs is not None:
                theirs.copy_(torch.cat([p.bias for p in mine]) if mine[0].bias is not None else 0.0)


class HostReads:
    """Records the ops run inside it that read tensor values back to the host: ``.item()`` and ``bool()``
    (``_local_scalar_dense``), ``nonzero``, boolean-mask indexing. On a GPU each one waits until the
    device has run everything queued before it; on a CPU they are found the same way. (Copies to the
    host, ``.cpu()`` and ``.tolist()``, are not told apart from copies within a CPU: not recorded.)"""

    ALWAYS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                masks = name in ("index", "index_put", "index_put_") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
                if name in HostReads.ALWAYS or masks:
                    seen.append(name)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

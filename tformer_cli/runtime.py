"""Run folders: atomic checkpoint writes, loading, resuming, averaging; seeding and RNG state.

A run folder::

    runs/NAME/
      config.yaml            the resolved config
      tokenizer.json         (or tokenizer-source.json + tokenizer-target.json)
      model.safetensors      the best weights so far (by train.best_metric), else the latest
      metrics.jsonl          every logged figure, one JSON object a line
      checkpoints/step-00001000/
        model.safetensors    weights
        trainer.pt           optimizer, step, epoch, data position, RNG state
      checkpoints/average-last-5/model.safetensors   (from `tformer average`)

Every file and checkpoint folder is written under a temporary name and renamed into place, so an
interrupted write never replaces a good file with a broken one.
"""

from __future__ import annotations

import contextlib
import pickle
import random
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from torch.overrides import TorchFunctionMode

from tformer_cli.config import Config, load_config, to_yaml
from tformer_cli.ensemble import Ensemble
from tformer_cli.errors import CheckpointError, UsageError, first_line
from tformer_cli.files import replacing, write_text_atomic
from tformer_cli.run_folder import (
    CHECKPOINTS, CONFIG, TRAINER, WEIGHTS, find_weights, is_average_folder, mark_run_folder, owning_run, read_metrics,
    remove_checkpoint, step_checkpoints)
from tformer_cli.tokenizer import PAD_ID, Vocabulary


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict[str, Any]:
    """The states of the generators training draws from: Python's, the CPU's and, training on a GPU,
    that GPU's alone (a resume may see more GPUs or fewer; a run on the CPU leaves CUDA untouched)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """``rng_state``'s generators set again, the GPU's into ``device`` (where training runs on one)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    saved = state.get("cuda")
    if device.type == "cuda" and saved is not None:
        if isinstance(saved, (list, tuple)):  # an older tformer's: every GPU it saw, the first the one it used
            saved = saved[0]
        torch.cuda.set_rng_state(saved, device)


def save_weights(model: torch.nn.Module, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Weights only, as safetensors (tied matrices stored once), written atomically (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        save_model(unwrapped(model), str(tmp), metadata=metadata)


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load safetensors weights into ``model``; CheckpointError (one line) when they do not fit it."""
    from safetensors import safe_open

    model = unwrapped(model)
    try:
        with safe_open(str(path), "pt") as stored:
            shapes = {name: tuple(stored.get_slice(name).get_shape()) for name in stored.keys()}
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable weights ({first_line(exc)}); pick another checkpoint") from exc
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    mismatched = sorted(name for name in shapes.keys() & expected.keys() if shapes[name] != expected[name])
    if mismatched:
        first = mismatched[0]
        raise CheckpointError(f"{path}: weights do not fit the model in config.yaml ({len(mismatched)} tensors "
                              f"differ in shape, e.g. {first}: {list(shapes[first])} stored, "
                              f"{list(expected[first])} in the model)")
    missing, unexpected = load_model(model, str(path), strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not fit the model in config.yaml "
                              f"(missing {len(missing)}, unexpected {len(unexpected)} tensors)")


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module itself, under ``torch.compile``'s wrapper (whose weights' names it prefixes)."""
    return getattr(model, "_orig_mod", model)


def checkpoint_folder(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{step:08d}"


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, trainer_state: dict[str, Any],
                    keep_last: int, fill: Callable[[Path], None] | None = None) -> Path:
    """Write checkpoints/step-N (weights + trainer state, and what ``fill`` writes into the folder)
    atomically; keep only the last ``keep_last``."""
    final = checkpoint_folder(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    with replacing(final) as tmp:
        tmp.mkdir()
        save_model(unwrapped(model), str(tmp / WEIGHTS))
        torch.save(trainer_state, tmp / TRAINER)
        if fill is not None:
            fill(tmp)
    for old in step_checkpoints(run_dir)[:-keep_last]:
        remove_checkpoint(old)
    return final


def load_trainer_state(checkpoint: Path | str) -> dict[str, Any]:
    """Optimizer, step and RNG state, read as plain tensors and containers only (``weights_only``): a
    run folder from elsewhere cannot run code when it is resumed, as the weights are safetensors."""
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols it then reads or refuses itself
            warnings.simplefilter("ignore")
            saved = torch.load(Path(checkpoint) / TRAINER, map_location="cpu", weights_only=True)
    except Exception as exc:
        why = "not a file tformer wrote; tformer never runs code from one" \
            if isinstance(exc, pickle.UnpicklingError) else first_line(exc)
        raise CheckpointError(f"{checkpoint}: unreadable trainer state ({why}); resume from an "
                              "earlier checkpoint by deleting this one") from exc
    if not isinstance(saved, dict) or not all(isinstance(saved.get(key), dict) for key in ("optimizer", "state", "rng")):
        raise CheckpointError(f"{checkpoint}: unreadable trainer state (not the one tformer writes); resume from an "
                              "earlier checkpoint by deleting this one")
    return saved


def save_run_files(run_dir: Path, config: Config, vocab: Vocabulary | None = None) -> None:
    """The run's marker, its config.yaml and (when given) its vocabulary, each written atomically."""
    mark_run_folder(run_dir)
    write_text_atomic(run_dir / CONFIG, to_yaml(config))
    if vocab is not None:
        vocab.save(run_dir)


def load_run_config(run_dir: Path) -> Config:
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{run_dir}: not a run folder (no config.yaml); pass the folder `tformer train` wrote, "
                              "e.g. runs/demo")
    config = load_config(path, saved_run=True)
    config.name = Path(run_dir).name
    return config


@dataclass
class LoadedRun:
    """Everything `eval`, `generate` and `inspect-attention` need, from one run folder."""

    run_dir: Path
    weights: Path
    config: Config
    vocab: Vocabulary
    model: torch.nn.Module


class skipping_random_init(TorchFunctionMode):
    """``with skipping_random_init(): model = build_model(...)`` leaves the parameters as allocated
    instead of drawing them, for a model whose weights are loaded next (``load_weights`` refuses a
    file that leaves any out). The draws are most of building a model: 0.65 s of 0.74 for base on a
    2-core CPU, and a third of `tformer generate`'s start for a model of big's width and depth.
    What is computed, not drawn (the positional tables), is built as usual."""

    FILLS = frozenset({"uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                       "xavier_uniform_", "xavier_normal_", "orthogonal_"})  # nn.init's and Tensor's

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in self.FILLS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def load_run(path: Path, device: torch.device | str = "cpu", accel: str = "auto", int8: bool = False) -> LoadedRun:
    """Build the model of a run folder (or checkpoint) and load its weights, in eval mode, with the
    speed layer ``accel`` (auto or off) applied, with int8 linear layers for CPU decoding if ``int8``."""
    from tformer_cli.accel import accelerate
    from tformer_cli.model import build_model

    run_dir, weights = find_weights(Path(path))
    config = load_run_config(run_dir)
    vocab = Vocabulary.load(run_dir)
    with skipping_random_init():
        model = build_model(config.model, vocab.src_size, vocab.tgt_size, PAD_ID)
    load_weights(model, weights)
    model = model.to(device).eval()
    model = accelerate(model, device, accel, int8=int8)
    return LoadedRun(run_dir, weights, config, vocab, model)


def load_ensemble(paths: list[Path], device: torch.device | str = "cpu", accel: str = "auto",
                  int8: bool = False) -> tuple[LoadedRun, Ensemble]:
    """The first run (its config and vocabulary serve the whole ensemble) and all runs' models as one
    ``Ensemble``; runs whose vocabularies differ are refused."""
    loaded = [load_run(path, device, accel, int8) for path in paths]
    first = loaded[0]
    for other in loaded[1:]:
        if (other.vocab.fingerprint(), other.vocab.joint) != (first.vocab.fingerprint(), first.vocab.joint):
            raise UsageError(f"--ensemble {other.run_dir}: its vocabulary differs from {first.run_dir}'s; ensembled "
                             "models must share one (e.g. runs trained on the same data and data.vocab_size)")
    return first, Ensemble([run.model for run in loaded])


def choose_checkpoints(run_dir: Path, last: int | None = None, best: int | None = None,
                       metric: str = "loss") -> list[Path]:
    """The last N step checkpoints, or the N with the best validation ``metric`` (loss: lower is better)."""
    checkpoints = step_checkpoints(run_dir)
    if not checkpoints:
        raise CheckpointError(f"{run_dir}: no step checkpoints to average")
    if (last is None) == (best is None):
        raise UsageError("give exactly one of --last N or --best N")
    count = last if last is not None else best
    if count < 1:
        raise UsageError(f"--{'last' if last is not None else 'best'} {count}: must be >= 1")
    if last is not None:
        _need_checkpoints(run_dir, f"--last {count}", count, len(checkpoints), "step checkpoints")
        return checkpoints[-count:]
    scores = {r["step"]: r[metric] for r in read_metrics(run_dir) if r.get("split") == "validation" and metric in r}
    scored = [c for c in checkpoints if int(c.name.split("-")[1]) in scores]
    if not scored:
        raise CheckpointError(f"{run_dir}: no validation {metric} recorded for the kept checkpoints; use --last N")
    _need_checkpoints(run_dir, f"--best {count}", count, len(scored), f"step checkpoints with a validation {metric}")
    sign = -1 if metric == "bleu" else 1
    return sorted(scored, key=lambda c: sign * scores[int(c.name.split("-")[1])])[:count]


def _need_checkpoints(run_dir: Path, flag: str, count: int, found: int, what: str) -> None:
    if found < count:
        raise UsageError(f"{flag}: {run_dir} keeps only {found} {what}; ask for at most {found}, "
                         f"or keep more with train.keep_last")


def _holds_an_average(path: Path) -> bool:
    """Whether ``path`` is weights that average_checkpoints wrote (their metadata says so)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as weights:
            return "averaged" in (weights.metadata() or {})
    except Exception:  # safetensors' own error for a file it cannot parse; a folder; no permission
        return False


def average_checkpoints(checkpoints: list[Path], output: Path, run_dir: Path) -> Path:
    """Element-wise mean of the checkpoints' weights (as the paper and fairseq do), saved atomically
    in the folder ``output``, which is returned: eval and generate take it as a checkpoint. Inside the
    run folder ``run_dir`` they find the run's config and tokenizer above it; elsewhere the folder gets
    copies of them, a run folder of its own."""
    from safetensors.torch import load_file, save_file

    if (output / WEIGHTS).exists() and not _holds_an_average(output / WEIGHTS):
        # replace an earlier average, never a run's or a checkpoint's own weights, nor a file of the user's
        raise UsageError(f"--output {output}: holds a {WEIGHTS} that is not an average; pick another folder")
    run_files = [CONFIG, *Vocabulary.files(run_dir)]
    owner = owning_run(output)  # the run folder that eval and generate would take the average's config from
    standalone = owner is None or owner.resolve() != Path(run_dir).resolve()
    if standalone and owner not in (None, output):
        raise UsageError(f"--output {output}: inside another run folder ({owner}), whose config and tokenizer "
                         f"would go with these weights; pick a folder inside {run_dir} or outside any run")
    if not standalone and not is_average_folder(output, run_dir):
        raise UsageError(f"--output {output}: inside the run folder, an average goes to "
                         f"{Path(run_dir) / CHECKPOINTS}/average-NAME; or pick a folder outside the run")
    # a standalone average's files may be replaced by the same bytes (an earlier average's), nothing else
    clashes = [name for name in run_files if standalone and (output / name).exists()
               and (output / name).read_bytes() != (Path(run_dir) / name).read_bytes()]
    if clashes:
        raise UsageError(f"--output {output}: holds a {clashes[0]} of its own, which the average would need to "
                         "replace; pick another folder")
    total: dict[str, torch.Tensor] = {}
    for checkpoint in checkpoints:
        try:
            weights = load_file(str(checkpoint / WEIGHTS))
        except Exception as exc:  # safetensors' own error for a file it cannot parse
            raise CheckpointError(f"{checkpoint / WEIGHTS}: unreadable weights ({first_line(exc)}); leave this "
                                  "checkpoint out (e.g. a smaller --last)") from None
        shapes = {name: tensor.shape for name, tensor in weights.items()}
        if total and shapes != {name: tensor.shape for name, tensor in total.items()}:
            raise CheckpointError(f"{checkpoint / WEIGHTS}: its weights differ in names or shapes from "
                                  f"{checkpoints[0].name}'s; average checkpoints of one run only")
        for name, tensor in weights.items():
            total[name] = total.get(name, 0) + tensor.double()
    average = {name: (tensor / len(checkpoints)).float().contiguous() for name, tensor in total.items()}
    created = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    try:
        with replacing(output / WEIGHTS) as tmp:
            save_file(average, str(tmp), metadata={"averaged": ",".join(c.name for c in checkpoints)})
        if standalone:  # the weights first: a folder with a config but no weights is not taken for a run
            for name in run_files:
                with replacing(output / name) as tmp:
                    shutil.copyfile(Path(run_dir) / name, tmp)
    except CheckpointError:
        if created:  # a full disk leaves no half-made average behind
            for name in (WEIGHTS, *run_files):
                (output / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                output.rmdir()
        raise
    return output

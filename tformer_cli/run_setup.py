"""What a run trains with: its state, saved in every checkpoint, and the model, data and optimizer
set up for a new or a resumed run (``Setup``). ``train.py`` runs the loop over them."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tformer_cli.accel import accelerate
from tformer_cli.config import Config, DataConfig, DecodeConfig
from tformer_cli.devices import autocast, memory_bytes, resolve_precision
from tformer_cli.encoding import (
    EncodedSplit, cached_vocabulary, encodings_cached, load_encoded, train_or_load_vocabulary)
from tformer_cli.ema import WeightEMA
from tformer_cli.errors import CheckpointError, ConfigError, DataError, first_line, out_of_memory
from tformer_cli.evaluation import Seq2SeqLoss, compiled_loss, compiles, label_smoothed_loss, validation_record
from tformer_cli.files import append_jsonl, json_line, read_jsonl, write_failed, write_text_atomic
from tformer_cli.launch import torchrun_variable
from tformer_cli.model import build_model
from tformer_cli.optim import make_optimizer
from tformer_cli.params import TRAINING_BYTES_PER_PARAMETER, table_bytes, total_params
from tformer_cli.parallel import Workers, distribute, gathered, load_optimizer_state, shard_like
from tformer_cli.preparing import prepare_apart, worth_preparing_apart
from tformer_cli.render import human_bytes
from tformer_cli.run_folder import METRICS, WEIGHTS, step_checkpoints
from tformer_cli.run_writer import RunWriter, writes_in_background
from tformer_cli.runtime import (
    load_trainer_state, load_weights, save_run_files, seed_everything, set_rng_state, skipping_random_init)
from tformer_cli.segmentation import Segmentation, Segmentations, draws_ahead, read_segmentation
from tformer_cli.tensorboard import TensorBoard
from tformer_cli.tokenizer import PAD_ID, Vocabulary

Callback = Callable[[str, dict[str, Any]], None]


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint so that a resumed run continues exactly."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # position in this epoch's batch order (in each process's share of it)
    processes: int = 1  # how many processes trained together
    accumulation: int = 1  # batches each process took a step (train.grad_accum, or what train.step_tokens needs)
    target_tokens: int = 0
    elapsed: float = 0.0  # seconds of training, summed over resumed sessions
    best: float | None = None
    best_step: int | None = None
    evals_without_improvement: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    train_data: str | None = None  # the training split's signature (EncodedSplit.signature)


class Setup:
    """Model, data and optimizer for a run, new or resumed."""

    def __init__(self, config: Config, run_dir: Path, resume: bool, device: torch.device, notify: Callback,
                 workers: Workers) -> None:
        self.config, self.run_dir, self.device, self.workers = config, run_dir, device, workers
        # under FSDP no process holds the whole model: rank 0 gathers it into a copy to validate and save
        self.sharded = workers.grouped and config.train.parallel == "fsdp"
        # every process reads the hub dataset's commit that rank 0 pinned (prepare_run) and records
        config.data = replace(config.data, revision=workers.from_main(config.data.revision))
        # in turns: rank 0 learns the vocabulary, fills the cache and writes the run folder; then the first
        # process of each other node (which fills that node's cache, if it has its own); then the rest
        turn = 0 if workers.main else 1 if workers.local_rank == 0 else 2
        for t in range(3 if workers.size > 1 else 1):
            if t == turn:
                self._load_data(resume, notify)
            workers.barrier()
        cfg = config.train
        seed_everything(cfg.seed)  # the same initial weights in every process
        checkpoint = self._last_checkpoint() if resume else None
        self._build_trainer(checkpoint)
        self.writer = RunWriter(writes_in_background(device))  # checkpoints: beside training on a GPU
        self.state, saved = TrainState(), {}
        # overrides given on resume are recorded in config.yaml with the first checkpoint made under them,
        # so that a resume whose overrides make it diverge leaves the run's config as it was
        self.config_unsaved = resume
        self.saved_step: int | None = None  # the step of the last checkpoint written or resumed from
        # the copy of the weights that this step's validation wrote as the best: the step's checkpoint (at
        # every validation's step by default) writes from it too; dropped at the step's end, not held on
        self.best_copy: torch.nn.Module | None = None
        if checkpoint is not None:
            saved = self._restore(checkpoint)
            self.saved_step = self.state.step
        data = self.train_data.signature()
        data_unchanged = self.state.train_data in (None, data)
        if not data_unchanged:
            notify("warning", {"message": f"the training split differs from the one {checkpoint.name} was trained on "
                               f"({len(self.train_data):,} pairs now): training goes on over the new data, so the "
                               "run will not match one that was never stopped"})
        self.state.train_data = data
        self.segmentations = self._segmentations(checkpoint, data_unchanged, notify) if config.data.bpe_dropout \
            else None
        self.segmentation: Segmentation | None = None  # the epoch's, under BPE-dropout: kept with its checkpoints
        # where rank 0 logs figures; TensorBoard drops what it logged after the checkpoint, as _restore
        # trims metrics.jsonl
        board = TensorBoard(run_dir, self.state.step + 1 if checkpoint is not None else None) \
            if cfg.tensorboard and workers.main else None
        self.log = MetricsLog(run_dir, board)
        # a moving average of the weights: continued on resume, else started from the weights as they are
        self.ema = WeightEMA(self.model, cfg.ema_decay, self.state.step) if cfg.ema_decay else None
        if self.ema is not None and "ema" in saved:
            shadow = [shard_like(t, s) for t, s in zip(saved["ema"]["shadow"], self.ema.shadow)]
            self.ema.load_state_dict({**saved["ema"], "shadow": shadow})

    def _build_trainer(self, checkpoint: Path | None) -> None:
        """The model (with ``checkpoint``'s weights, if given), the objective that DDP or FSDP wraps, the
        optimizer over the parameters as distributed, and the precision with its gradient scaler."""
        cfg, device, workers = self.config.train, self.device, self.workers
        self._check_fits()
        self.compiled = compiles(cfg.compile, device)
        self.model = self._build_model(draw=checkpoint is None)  # resumed: the weights come from the checkpoint
        if checkpoint is not None:
            load_weights(self.model, checkpoint / WEIGHTS)
        # the objective in one module, for DDP or FSDP to wrap when several processes train
        loss = compiled_loss() if self.compiled else label_smoothed_loss
        layers = [*self.model.encoder.layers, *self.model.decoder.layers]
        self.trainer = distribute(Seq2SeqLoss(self.model, cfg.label_smoothing, cfg.rdrop, loss), layers, workers,
                                  cfg.parallel, device)
        self.replica = self._build_model() if self.sharded and workers.main else None
        self.replica_step: int | None = None  # the training step whose weights were gathered into it
        self.optimizer = make_optimizer(self.model, cfg, device)  # over the parameters as distributed
        # fp16's loss scale, found over many steps, is kept in checkpoints so that a resume starts from it
        self.precision = resolve_precision(cfg.precision, device)  # auto: bf16 on a recent GPU, fp32 elsewhere
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.precision == "fp16")

    def epoch_split(self) -> EncodedSplit:
        """The training split of the epoch under way: under BPE-dropout, segmented for it."""
        if self.segmentations is None:
            return self.train_data
        self.segmentation = self.segmentations.of_epoch(self.state.epoch)
        return self.segmentation.split

    def _segmentations(self, checkpoint: Path | None, data_unchanged: bool, notify: Callback) -> Segmentations:
        """BPE-dropout's draws; resumed, first the one the checkpoint was trained on."""
        resumable = checkpoint is not None and data_unchanged
        resumed = read_segmentation(checkpoint, self.state.epoch) if resumable else None
        if resumable and resumed is None and self.state.batch_in_epoch:
            notify("warning", {"message": f"{checkpoint.name} holds no BPE-dropout segmentation of its epoch: the "
                               "rest of the epoch is segmented afresh, so the run will not match one that was never "
                               "stopped"})
        return Segmentations(self.train_data, self.vocab, self.config.data, self.workers, draws_ahead(self.device),
                             resumed)

    def _check_fits(self) -> None:
        """ConfigError where the training state alone, 16 bytes a parameter (fp32 weights, gradients and
        Adam's two moments; this process's share under FSDP) with the positional tables, is more than its
        share of the device's memory (the CPU's RAM is shared by this machine's processes): past it the OS
        would kill the process without a word, once the model was built or at the first step."""
        memory = memory_bytes(self.device)
        if memory is None:
            return
        parameters = total_params(self.config.model, self.vocab.src_size, self.vocab.tgt_size)
        weights = TRAINING_BYTES_PER_PARAMETER * parameters // (self.workers.size if self.sharded else 1)
        tables = table_bytes(self.config.model)
        share = memory // (torchrun_variable("LOCAL_WORLD_SIZE") if self.device.type == "cpu" else 1)
        if weights + tables > share:
            with_tables = f" and {human_bytes(tables)} for its positional tables" if tables else ""
            raise _too_big(self.config, self.vocab, self.device, f"training its {parameters:,} parameters needs "
                           f"at least {human_bytes(weights)} for weights, gradients and Adam's moments"
                           f"{with_tables}, and this process has {human_bytes(share)}")

    def _build_model(self, draw: bool = True) -> torch.nn.Module:
        """The model on the training device, with the speed layer (a compiled run's without the modules
        it swaps in); its weights drawn, or with ``draw`` False left as allocated, for weights loaded next."""
        try:
            with nullcontext() if draw else skipping_random_init():
                model = build_model(self.config.model, self.vocab.src_size, self.vocab.tgt_size, PAD_ID)
            model = model.to(self.device)
        except RuntimeError as exc:  # the model alone: lowering train.max_tokens, the usual advice, cannot help
            if not out_of_memory(exc):
                raise
            raise _too_big(self.config, self.vocab, self.device) from None
        # the speed layer, unless train.accel is off; compiled, without the modules it would swap in
        return accelerate(model, self.device, self.config.train.accel, compiled=self.compiled)

    @property
    def validates_together(self) -> bool:
        """Under DDP every process holds the whole model and validates a share; under FSDP rank 0 alone
        (on the whole weights, gathered), and the others take its figures."""
        return self.workers.size > 1 and not self.sharded

    @property
    def validates_here(self) -> bool:
        """Whether this process validates (all of the split, or its share): it then loads the split."""
        return self.validates and (self.workers.main or self.validates_together)

    def validate(self, model: torch.nn.Module, step: int, decode: DecodeConfig | None = None,
                 together: bool = False) -> dict[str, Any]:
        """``evaluation.validation_record`` of ``model``, in the precision training computes in (bf16
        autocast on a GPU that trains in bf16, as fairseq validates); ``together``: every process
        computes its share."""
        with autocast(self.device, self.precision):
            return validation_record(model, self.vocab, self.valid_data, self.config.train,
                                     decode or self.config.decode, step, self.device, self.workers if together else None)

    def whole_model(self, step: int | None = None) -> torch.nn.Module | None:
        """The model with its whole weights on rank 0 (None on the others). Under FSDP a collective
        that every process calls: the shards are gathered into rank 0's copy, once for a training
        ``step`` (its validation and checkpoint share the copy: every process skips the gather alike);
        without a step, every call (the moving average's weights, swapped in)."""
        if not self.sharded:
            return self.model if self.workers.main else None
        if step is None or step != self.replica_step:
            weights = gathered(self.model.state_dict())
            if self.workers.main:
                self.replica.load_state_dict(weights)
            self.replica_step = step
        return self.replica

    def _load_data(self, resume: bool, notify: Callback) -> None:
        data = self.config.data
        warned: set[str] = set()

        def warn(message: str) -> None:
            if message not in warned:  # where the cache cannot be written, the work is done twice
                warned.add(message)
                notify("warning", {"message": message})

        # the other processes, and a resumed run, take the vocabulary in the run folder (rank 0's)
        from_run = resume or not self.workers.main
        vocab = run_vocabulary(self.run_dir, self.workers) if from_run else cached_vocabulary(data)
        self.validates = data.validation_split is not None
        splits = [data.train_split, *([data.validation_split] if self.validates_here else [])]
        if worth_preparing_apart(data) and not (vocab is not None and encodings_cached(data, splits, vocab)):
            # learnt and tokenised by a child process; this one reads the cache
            learning = "" if vocab is not None else "learning the BPE vocabulary and "
            notify("setup", {"message": f"{learning}tokenising"})
            for message in prepare_apart(data, splits, self.run_dir if from_run else None):
                warn(message)
        self.vocab = vocab if vocab is not None else train_or_load_vocabulary(data, warn)
        self.train_data = load_encoded(data, data.train_split, self.vocab, warn)
        self.valid_data = load_encoded(data, data.validation_split, self.vocab, warn) if len(splits) > 1 else None
        for split, encoded in ((data.train_split, self.train_data), (data.validation_split, self.valid_data)):
            if encoded is not None and len(encoded) == 0:
                raise _nothing_left(split, encoded, data)
        if not resume and self.workers.main:  # once the data has loaded: a start that fails on it leaves nothing
            save_run_files(self.run_dir, self.config, self.vocab)

    def _last_checkpoint(self) -> Path:
        checkpoints = step_checkpoints(self.run_dir)
        if not checkpoints:
            raise CheckpointError(f"{self.run_dir}: no checkpoint to resume from; start a new run instead")
        return checkpoints[-1]

    def _restore(self, checkpoint: Path) -> dict:
        """The trainer state of ``checkpoint`` (whose weights are loaded already)."""
        saved = load_trainer_state(checkpoint)
        try:
            load_optimizer_state(self.optimizer, saved["optimizer"])
            if self.scaler.is_enabled() and "scaler" in saved:
                self.scaler.load_state_dict(saved["scaler"])
            self.state = TrainState(**saved["state"])
            set_rng_state(saved["rng"], self.device)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:  # what torch raises for a state that does not fit
            raise CheckpointError(f"{checkpoint}: its trainer state does not fit this run ({first_line(exc)}); "
                                  "resume from an earlier checkpoint by deleting this one") from None
        if self.workers.main:  # what was logged after that checkpoint is logged again as training repeats it
            metrics = self.run_dir / METRICS
            if metrics.is_file():
                kept = [r for r in read_jsonl(metrics) if r.get("step", 0) <= self.state.step]
                write_text_atomic(metrics, "".join(json_line(r) for r in kept))
        return saved


def _too_big(config: Config, vocab: Vocabulary, device: torch.device, why: str = "") -> ConfigError:
    """What to lower when the model does not fit (``why``: by how much, where known): model.max_len
    where its positional tables (learned ones trained as weights) take more of the memory than the other
    weights, else the model's width and depth."""
    m, where = config.model, f"the model does not fit in the {device.type.upper()}'s memory{f' ({why})' if why else ''}"
    learned = 2 * m.max_len * m.d_model if m.positional == "learned" else 0  # a table a stack
    weights = total_params(m, vocab.src_size, vocab.tgt_size) - learned
    if table_bytes(m) + TRAINING_BYTES_PER_PARAMETER * learned > TRAINING_BYTES_PER_PARAMETER * weights:
        return ConfigError(f"{where}: its positional tables have a row for each of model.max_len's {m.max_len:,} "
                           f"positions; lower model.max_len to what the data needs (data.max_length is "
                           f"{config.data.max_length})")
    return ConfigError(f"{where}: lower model.d_model, model.d_ff or the number of layers (tformer count-params "
                       "CONFIG shows what it needs)")


def _nothing_left(split: str, encoded: EncodedSplit, data: DataConfig) -> DataError:
    """Why every pair of a split was dropped, and what to change."""
    if encoded.dropped_long == 0:
        return DataError(f"no {split} pairs left: all {encoded.dropped_empty:,} have an empty (or null) "
                         f"{data.source} or {data.target}; check data.source and data.target")
    empty = f" and {encoded.dropped_empty:,} empty" if encoded.dropped_empty else ""
    return DataError(f"no {split} pairs left: {encoded.dropped_long:,} are longer than data.max_length "
                     f"{data.max_length} tokens{empty}; raise data.max_length or set data.long_pairs: truncate")


def run_vocabulary(run_dir: Path, workers: Workers) -> Vocabulary:
    """The vocabulary saved in the run folder: by rank 0, before the other processes look for it."""
    try:
        return Vocabulary.load(run_dir)
    except CheckpointError:
        if workers.main:
            raise
        raise CheckpointError(f"{run_dir}: process {workers.rank} does not see the tokenizer that process 0 wrote "
                              "there; with several machines, put the run folder (--output-dir) on storage every "
                              "machine sees") from None


class MetricsLog:
    """Where rank 0 logs figures: metrics.jsonl, and TensorBoard's copy under train.tensorboard."""

    def __init__(self, run_dir: Path, board: TensorBoard | None = None) -> None:
        self.path, self.board = run_dir / METRICS, board

    def write(self, split: str, record: dict[str, Any]) -> None:
        try:
            append_jsonl(self.path, {"split": split, **record})
        except OSError as exc:  # a full disk: the records before are intact, a cut last line is dropped
            raise write_failed(self.path, exc, "the records before are intact") from exc
        if self.board is not None:
            self.board.write(split, record)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()

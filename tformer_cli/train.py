"""The training loop: one explicit function, reading in order
batch -> forward -> loss -> backward -> clip -> step -> schedule -> callback -> evaluation -> checkpoint.

Progress leaves through ``callback(event, data)``; nothing here prints. Under ``torchrun`` several
processes train together (``parallel.py``: DDP or FSDP2): batches are sharded by rank, so is validation
under DDP, and only rank 0 logs and saves.
"""

from __future__ import annotations

import functools
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tformer_cli.accel import build_decoding_kernels, build_kernels
from tformer_cli.batching import Batch, batches_per_step, collate, epoch_batches
from tformer_cli.config import Config, DecodeConfig, TrainConfig
from tformer_cli.devices import autocast, matmul_peak, memory_mib, resolve_device, slow_precision
from tformer_cli.encoding import EncodedSplit
from tformer_cli.errors import DivergedError, UsageError
from tformer_cli.evaluation import (Seq2SeqLoss, label_smoothed_loss, validates_bleu, validation_record,
                                    validation_rows)
from tformer_cli.optim import cosine_horizon, learning_rate
from tformer_cli.packing import pack
from tformer_cli.parallel import Workers, gathered, gradient_sync, local, optimizer_state
from tformer_cli.params import train_flops_per_token
from tformer_cli.run_folder import CHECKPOINTS, WEIGHTS, holding
from tformer_cli.run_setup import Callback, MetricsLog, Setup, TrainState
from tformer_cli.run_writer import writing
from tformer_cli.runs import StopSignals
from tformer_cli.runtime import (checkpoint_folder, rng_state, save_checkpoint, save_run_files, save_weights,
                                 step_checkpoints)
from tformer_cli.tensorboard import check_available as check_tensorboard


@dataclass
class TrainResult:
    run_dir: Path
    state: TrainState
    stop_reason: str
    last_eval: dict[str, Any] | None
    signal: int | None = None  # the signal that stopped training, if one did (here, or in another process)


def train(config: Config, run_dir: Path, resume: bool = False, callback: Callback | None = None,
          workers: Workers = Workers()) -> TrainResult:
    """Train ``config`` into ``run_dir`` (or continue the run there when ``resume``), as one of
    ``workers`` (see ``parallel.py``; by default the only process). The process that writes the run
    holds its folder meanwhile: another ``tformer train`` on it stops with one line."""
    with holding(run_dir) if workers.main else nullcontext():
        return _train(config, run_dir, resume, callback, workers)


def _train(config: Config, run_dir: Path, resume: bool, callback: Callback | None, workers: Workers) -> TrainResult:
    notify: Callback = callback if callback and workers.main else (lambda event, data: None)
    cfg = config.train
    if cfg.tensorboard:
        check_tensorboard()  # before any data is loaded
    device = resolve_device(cfg.device)
    resume = resume and bool(step_checkpoints(run_dir))  # a run stopped before its first checkpoint starts anew
    signals = StopSignals()
    with signals.during_setup():
        setup = Setup(config, run_dir, resume, device, notify, workers)
    model, state, data = setup.model, setup.state, setup.epoch_split()
    accumulation = batches_per_step(cfg, workers.size)
    _resume_in_batches_of_now(state, cfg, workers.size, accumulation)
    amp = autocast(device, setup.precision)
    slow = slow_precision(device, setup.precision)
    if slow:
        notify("warning", {"message": f"train.precision {slow}; set train.precision=fp32"})
    # this epoch's batches (0.4 s on a WMT-sized corpus)
    batches = epoch_batches(data, cfg, state.epoch, workers.rank, workers.size)
    first_epoch = batches if state.epoch == 0 else epoch_batches(data, cfg, 0, workers.rank, workers.size)
    if not first_epoch:  # else every epoch would end before its first step
        raise UsageError(_no_step(cfg, len(data), workers.size, accumulation))
    steps_per_epoch = math.ceil(len(first_epoch) / accumulation)
    total_steps = _total_steps(cfg, steps_per_epoch)
    notify("start", _start_info(setup, steps_per_epoch, accumulation, total_steps))
    if rise := _cosine_restarted(setup, total_steps):
        notify("warning", {"message": rise})
    flops = _model_flops(setup, data, None if slow else matmul_peak(device, setup.precision))
    with signals.during_setup():  # set-up: a signal stops it at once, and the clocks start after it
        _build_kernels(setup, data, batches)
    # a resumed run may already be at its limit
    stop_reason, last_eval = _stop_reason(cfg, state, state.batch_in_epoch >= len(batches)), None
    stopped_by: int | None = None
    window = {"loss": 0.0, "tokens": 0, "start": time.perf_counter()}
    session_start, elapsed_before = time.perf_counter(), state.elapsed
    setup.trainer.train()
    # writes done on leaving; a failed one (a full disk) names the last intact checkpoint and how to resume
    with signals.between_steps(), writing(run_dir), setup.writer.finishing():
        while stop_reason is None:
            while state.batch_in_epoch < len(batches) and stop_reason is None:
                # batch: this process's share of one optimizer step, consecutive batches
                start = state.batch_in_epoch
                group = [_collate(data, ids, cfg) for ids in batches[start:start + accumulation]]
                group_tokens = sum(b.num_tokens for b in group)
                stopped_by = signals.received  # a signal stops training between two steps
                if workers.size > 1:  # the loss is normalised by every process's tokens; rank 0's clock rules
                    own_clock = elapsed_before + time.perf_counter() - session_start if workers.main else 0.0
                    total, clock, *got = workers.sum(group_tokens, own_clock,
                                                     *(signum == stopped_by for signum in StopSignals.SIGNALS))
                    group_tokens = int(total)
                    # all processes stop at the same step, by a signal that any got (on another machine, maybe)
                    stopped_by = next((signum for signum, n in zip(StopSignals.SIGNALS, got) if n), None)
                if stopped_by is not None:
                    stop_reason = "interrupted"
                    break
                nll_sum, lr = _step(setup, group, group_tokens, total_steps, amp)
                state.step += 1
                state.batch_in_epoch += len(group)
                state.target_tokens += group_tokens
                state.elapsed = clock if workers.size > 1 else elapsed_before + time.perf_counter() - session_start
                window["loss"] += nll_sum
                window["tokens"] += group_tokens
                if state.step % cfg.log_every == 0:  # callback
                    _log(notify, setup.log, state, window, lr, total_steps, workers, model, flops, device)
                stop_reason = _stop_reason(cfg, state, state.batch_in_epoch >= len(batches))
                paused = time.perf_counter()  # validation and checkpoints do not count in training tokens/s
                if setup.validates and (state.step % cfg.eval_every == 0 or stop_reason):  # evaluation
                    last_eval = _evaluate(setup, state, notify)
                    if cfg.patience and state.evals_without_improvement >= cfg.patience and not stop_reason:
                        stop_reason = f"no improvement in {cfg.patience} evaluations (early stopping)"
                if state.step % (cfg.save_every or cfg.eval_every) == 0 or stop_reason:  # checkpoint
                    _checkpoint(setup, notify)
                setup.best_copy = None  # a host copy of the weights on a GPU: not held until a later checkpoint
                window["start"] += time.perf_counter() - paused
            if state.batch_in_epoch >= len(batches):
                state.epoch += 1
                state.batch_in_epoch = 0
                stop_reason = stop_reason or _stop_reason(cfg, state)
                if stop_reason is None:
                    data = setup.epoch_split()  # the next epoch's segmentation and batches
                    batches = epoch_batches(data, cfg, state.epoch, workers.rank, workers.size)
        if stop_reason == "interrupted" and setup.saved_step != state.step:
            _checkpoint(setup, notify)  # at a step boundary, so that a resume continues exactly
    setup.log.close()
    notify("end", {"state": asdict(state), "stop_reason": stop_reason, "last_eval": last_eval})
    return TrainResult(run_dir, state, stop_reason, last_eval, signals.received or stopped_by)


def _step(setup: Setup, group: list[Batch], group_tokens: int, total_steps: int | None,
          amp) -> tuple[torch.Tensor, float]:
    """One optimizer step over ``group``, this process's batches of the step, whose gradients add up: forward,
    loss and backward of each, then clipping, the schedule's learning rate and the update. Returns the
    group's summed NLL (on the device: no sync) and the learning rate. ``group_tokens``: the target
    tokens of every process's group, which the loss is normalised by."""
    cfg, workers, state = setup.config.train, setup.workers, setup.state
    trainer, optimizer, scaler = setup.trainer, setup.optimizer, setup.scaler
    if not workers.main:  # dropout masks of their own, drawn so that a resumed run draws them again
        torch.manual_seed(cfg.seed + 1_000_003 * workers.rank + state.step)
    nll_sum = torch.zeros((), device=setup.device)  # summed on the device: no sync per batch
    for i, batch in enumerate(group):
        # gradients are synced across processes in the last micro-batch's backward only
        with workers.together(), gradient_sync(trainer, last=i == len(group) - 1):
            with amp:  # forward + loss
                loss, nll = trainer(batch.to(setup.device))
            # DDP and FSDP average over processes; the loss is normalised by all their tokens
            scaler.scale(loss * (workers.size / group_tokens)).backward()  # backward
        nll_sum += nll
    scaler.unscale_(optimizer)
    if cfg.clip_grad_norm:  # clip; under FSDP the norm of the sharded gradients is a collective
        with workers.together():
            torch.nn.utils.clip_grad_norm_(setup.model.parameters(), cfg.clip_grad_norm)
    horizon = cosine_horizon(cfg, total_steps, state.step, state.elapsed) if cfg.schedule == "cosine" else None
    lr = learning_rate(state.step + 1, cfg, setup.config.model.d_model, horizon)  # schedule
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    scaler.step(optimizer)  # step
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if setup.ema is not None:
        setup.ema.update()
    return nll_sum, lr


def _collate(data: EncodedSplit, ids: list[int], cfg: TrainConfig) -> Batch:
    """A training batch: padded, or with ``train.pack_length`` its pairs packed into rows."""
    batch = collate(data, ids)
    return batch if cfg.pack_length is None else pack(batch, cfg.pack_length)


def _resume_in_batches_of_now(state: TrainState, cfg: TrainConfig, processes: int, accumulation: int) -> None:
    """A resumed run's place in its epoch (``state.batch_in_epoch``) counted in this session's batches,
    where the number of processes or of batches a step has changed."""
    if cfg.step_tokens is not None:  # the epoch's steps are all processes', whatever their number
        state.batch_in_epoch = state.batch_in_epoch // state.accumulation * accumulation
    elif state.processes != processes:  # the same batches, dealt to another number: same place in the epoch
        state.batch_in_epoch = math.ceil(state.batch_in_epoch * state.processes / processes)
    state.processes, state.accumulation = processes, accumulation


def _cosine_restarted(setup: Setup, total_steps: int | None) -> str | None:
    """Why a resumed cosine run's next learning rate is above its last one (past warmup the schedule
    only falls): its limits were raised, and the decay stretched over them restarts from higher up."""
    cfg, state = setup.config.train, setup.state
    if cfg.schedule != "cosine" or state.step == 0 or state.step < cfg.warmup_steps:
        return None
    last = setup.optimizer.param_groups[0]["lr"]  # the last step's, from the checkpoint's optimizer state
    horizon = cosine_horizon(cfg, total_steps, state.step, state.elapsed)
    upcoming = learning_rate(state.step + 1, cfg, setup.config.model.d_model, horizon)
    if upcoming <= last * 1.01 + 1e-12:
        return None
    go_on = (f"; to go on at the rate reached, resume with --set train.schedule=constant --set train.lr={last:.3g}"
             if last > 0 else "")
    return (f"the learning rate rises from {last:.3g} at step {state.step} to {upcoming:.3g}: the cosine schedule "
            f"decays over train.max_steps (or epochs, max_time), so raising them stretches its whole decay{go_on}")


def _no_step(cfg: TrainConfig, pairs: int, processes: int, accumulation: int) -> str:
    if cfg.step_tokens is None:
        return (f"the training split ({pairs:,} pairs) makes fewer batches of train.max_tokens {cfg.max_tokens:,} "
                f"than the {processes} processes; lower train.max_tokens, or train with fewer processes")
    where = f" on {processes} processes" if processes > 1 else ""
    # a step split into fewer batches: fewer max_tokens shares of it, or, at one a process, fewer processes
    fix = ("lower train.step_tokens or raise train.max_tokens" if accumulation > 1
           else "raise train.step_tokens, or train with fewer processes")
    return (f"train.step_tokens {cfg.step_tokens:,}: no step of the training split ({pairs:,} pairs) has a sentence "
            f"for each of its {processes * accumulation} batches ({accumulation} a process{where}, to stay within "
            f"train.max_tokens {cfg.max_tokens:,}); {fix}")


def _build_kernels(setup: Setup, data: EncodedSplit, batches: list[list[int]]) -> None:
    """Have the speed layer compile, before the first step, the matrix-product kernels that training
    would otherwise build as it meets them: those of validation's decoding, in its precision, on the
    processes that validate (``linear.build_decoding_kernels``); then those of this epoch's batch shapes and of
    validation, one pass of the objective per shape and one validation (``gemm.build_kernels`` says
    why; it does nothing where products are not on oneDNN). The latter not under torch.compile or
    autocast, whose products are not these, nor under FSDP, whose passes would be collectives.
    Nothing is built off the CPU or without the speed layer."""
    cfg = setup.config.train
    if setup.device.type != "cpu":
        return
    if setup.validates_here and validates_bleu(cfg):
        sentences = min(cfg.eval_max_sentences, len(setup.valid_data.pairs))
        sentences = math.ceil(sentences / setup.workers.size) if setup.validates_together else sentences
        with autocast(setup.device, setup.precision):  # validation's precision: its kernels' data type
            build_decoding_kernels(setup.replica if setup.sharded else setup.model,
                                   validation_rows(setup.config.decode, sentences))
    if setup.compiled or setup.precision != "fp32" or setup.sharded:
        return
    src, tgt = data.src.lengths(), data.tgt.lengths()
    shapes: dict[tuple[int, int, int], list[int]] = {}
    for ids in batches:
        rows = torch.tensor(ids)
        shapes.setdefault((len(ids), int(src[rows].max()), int(tgt[rows].max())), ids)
    objective = Seq2SeqLoss(setup.model, cfg.label_smoothing, cfg.rdrop, label_smoothed_loss)
    params = [p for p in setup.model.parameters() if p.requires_grad]

    def one_pass(ids: list[int]) -> None:
        loss, _ = objective(_collate(data, ids, cfg).to(setup.device))
        torch.autograd.grad(loss, params, allow_unused=True)

    passes = [functools.partial(one_pass, ids) for ids in shapes.values()]
    if setup.validates_here:  # validation's loss, and its decoding's encoder: one token decoded
        one_token = replace(setup.config.decode, max_len_a=0.0, max_len_b=1)
        passes.append(functools.partial(_validate, setup, setup.model, setup.state.step, one_token))
    build_kernels(passes)


def _start_info(setup: Setup, steps_per_epoch: int, batches_per_step: int, total_steps: int | None) -> dict[str, Any]:
    data = setup.train_data
    return {"run_dir": str(setup.run_dir), "device": str(setup.device), "processes": setup.workers.size,
            "precision": setup.precision, "compiled": setup.compiled, "resumed_at": setup.state.step,
            "parameters": sum(p.numel() for p in setup.model.parameters()), "train_pairs": len(data),
            "validation_pairs": len(setup.valid_data) if setup.valid_data else 0,
            "dropped_long": data.dropped_long, "dropped_empty": data.dropped_empty, "truncated": data.truncated,
            "steps_per_epoch": steps_per_epoch, "batches_per_step": batches_per_step, "total_steps": total_steps,
            "vocab_size": setup.vocab.tgt_size, "epoch": setup.state.epoch}


def _check_finite(model: torch.nn.Module, step: int, workers: Workers, loss: float | None = None) -> None:
    """Stop a run whose weights have become inf or NaN before it logs on or saves them over good
    checkpoints; every process decides the same (FSDP: each holds a part of the weights). (A single inf
    or NaN loss alone is not divergence: with fp16 the gradient scaler skips that step.) Summing the
    weights finds any inf or NaN among them (inf - inf is NaN), in one read of them, far faster than
    isfinite() on each weight (benchmarks/README.md)."""
    total, = workers.sum(float(torch.stack([local(p).detach().sum() for p in model.parameters()]).sum()))
    if math.isfinite(total):
        return
    logged = f" (loss {loss:.4g} over the last steps)" if loss is not None else ""
    raise DivergedError(f"training diverged at step {step}: the weights are no longer finite{logged}; the "
                        "checkpoints saved before are kept: resume from the last with a lower train.lr "
                        "(tformer train --resume RUN --set train.lr=...), or set train.clip_grad_norm")


def _total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int | None:
    limits = [cfg.max_steps] if cfg.max_steps else []
    if cfg.epochs:
        limits.append(cfg.epochs * steps_per_epoch)
    return min(limits) if limits else None


def _stop_reason(cfg: TrainConfig, state: TrainState, epoch_over: bool = False) -> str | None:
    """Why training stops after the step it is at (None: it goes on); ``epoch_over``: that step ends its
    epoch, so that the last epoch's last step is validated and saved as the last step of a run."""
    if cfg.max_steps and state.step >= cfg.max_steps:
        return f"reached train.max_steps {cfg.max_steps}"
    if cfg.epochs and state.epoch + epoch_over >= cfg.epochs:
        return f"reached train.epochs {cfg.epochs}"
    if cfg.max_time and state.elapsed >= cfg.max_time:
        return f"reached train.max_time {cfg.max_time:g} s"
    return None


def _model_flops(setup: Setup, data: EncodedSplit, peak: float | None) -> dict[str, float | None]:
    """What a target token of training costs in the model's matrix products (``train_flops_per_token``
    at this split's source tokens per target token), and the FLOP/s that all processes together
    could reach (``matmul_peak`` on each device; None where the precision is emulated)."""
    targets = data.tgt.offsets[-1].item() - len(data)  # the targets' tokens after <s>
    per_token = train_flops_per_token(setup.config.model, setup.vocab.tgt_size,
                                      data.src.offsets[-1].item() / max(targets, 1))
    return {"per_token": per_token, "peak": peak * setup.workers.size if peak else None}


def _log(notify: Callback, log: "MetricsLog", state: TrainState, window: dict, lr: float, total: int | None,
         workers: Workers, model: torch.nn.Module, flops: dict[str, float | None], device: torch.device) -> None:
    now = time.perf_counter()
    nll_sum, = workers.sum(float(window["loss"]))  # the one host sync per log interval; window tokens: all's
    loss = nll_sum / max(window["tokens"], 1)
    rate = window["tokens"] / max(now - window["start"], 1e-9)
    record = {"step": state.step, "epoch": state.epoch, "loss": loss, "ppl": math.exp(min(loss, 50)), "lr": lr,
              "tokens_per_s": rate, "tflops": rate * flops["per_token"] / 1e12, "elapsed": state.elapsed,
              "total_steps": total}
    if flops["peak"]:
        record["mfu"] = rate * flops["per_token"] / flops["peak"]
    record.update(memory_mib(device))  # this process's; the GPU's peak includes validation since the last line
    if workers.main:
        log.write("train", record)
    notify("step", record)
    window.update(loss=0.0, tokens=0, start=now)
    _check_finite(model, state.step, workers, loss)


def _evaluate(setup: Setup, state: TrainState, notify: Callback) -> dict[str, Any]:
    """Validation loss (and BLEU when configured), on every process's share of the sentences under DDP
    or on rank 0; track the best weights and early stopping."""
    cfg, main = setup.config.train, setup.workers.main
    _check_finite(setup.model, state.step, setup.workers)  # NaN weights would be the first run's "best"
    notify("evaluating", {"step": state.step})
    model = setup.whole_model(state.step)
    if setup.validates_together:
        record = _validate(setup, setup.model, state.step, together=True)
    else:
        record = setup.workers.from_main(_validate(setup, model, state.step) if main else None)
    metric = -record["bleu"] if cfg.best_metric == "bleu" else record["loss"]
    improved = state.best is None or metric < state.best
    if improved:
        state.best, state.best_step, state.evals_without_improvement = metric, state.step, 0
        if main:
            weights, best = setup.writer.weights(model), {"step": str(state.step)}
            setup.writer.submit(lambda: save_weights(weights, setup.run_dir / WEIGHTS, best))
            setup.best_copy = weights
    else:
        state.evals_without_improvement += 1
    record["best"] = improved
    state.history.append(record)
    if main:
        setup.log.write("validation", record)
    notify("eval", record)
    return record


def _validate(setup: Setup, model: torch.nn.Module, step: int, decode: DecodeConfig | None = None,
              together: bool = False) -> dict[str, Any]:
    """``evaluation.validation_record`` of ``model``, in the precision training computes in (bf16 autocast
    on a GPU that trains in bf16, as fairseq validates); ``together``: every process computes its share."""
    with autocast(setup.device, setup.precision):
        return validation_record(model, setup.vocab, setup.valid_data, setup.config.train,
                                 decode or setup.config.decode, step, setup.device, setup.workers if together else None)


def _checkpoint(setup: Setup, notify: Callback) -> None:
    """Weights and trainer state, whole tensors whatever the number of processes (so that a run resumes
    on any number), written by rank 0. Under FSDP every process takes part in gathering them."""
    state = setup.state
    _check_finite(setup.model, state.step, setup.workers)  # on every process, so that all of them stop together
    if not (setup.sharded or setup.workers.main):  # DDP: rank 0 holds everything it writes
        setup.saved_step = state.step
        return
    trainer_state = {"optimizer": optimizer_state(setup.optimizer), "state": asdict(state),
                     "rng": rng_state(setup.device)}
    if setup.ema is not None:
        trainer_state["ema"] = gathered(setup.ema.state_dict())
    if setup.scaler.is_enabled():
        trainer_state["scaler"] = setup.scaler.state_dict()
    model, writer, run_dir, step = setup.whole_model(state.step), setup.writer, setup.run_dir, state.step
    if setup.workers.main:  # the weights and state of this step, written now or beside the next steps
        weights = setup.best_copy if setup.best_copy is not None else writer.weights(model)
        trainer_state = writer.frozen(trainer_state)
        config = setup.config if setup.config_unsaved else None  # the config the checkpoint continues under
        latest = not setup.validates  # no validation: the latest weights are the run's weights
        segmentation = setup.segmentation  # under BPE-dropout, the epoch's, for a resume to continue over

        def write() -> None:
            folder = save_checkpoint(run_dir, step, weights, trainer_state, setup.config.train.keep_last,
                                     segmentation.store if segmentation is not None else None)
            if segmentation is not None:
                segmentation.note_stored(folder)
            if config is not None:
                save_run_files(run_dir, config)
            if latest:
                save_weights(weights, run_dir / WEIGHTS, {"step": str(step)})
        writer.submit(write)
        setup.config_unsaved = False
    if setup.ema is not None:  # the average as a checkpoint of its own, for eval and generate
        with setup.ema.applied():
            average = setup.whole_model()
            if setup.workers.main:
                average, about = writer.weights(average), {"step": str(step), "ema_decay": str(setup.ema.decay)}
                writer.submit(lambda: save_weights(average, run_dir / CHECKPOINTS / "ema" / WEIGHTS, about))
    if setup.workers.main:  # announced once its files are on disk: on a GPU, from the writer's thread
        writer.submit(lambda: notify("checkpoint", {"step": step, "path": str(checkpoint_folder(run_dir, step))}))
    setup.saved_step = step

"""The training loop: one explicit function, reading in order
batch -> forward -> loss -> backward -> clip -> step -> schedule -> callback -> evaluation -> checkpoint.

What a run does before its first step (its batches, steps and limits) is ``train_plan.py``, and the
speed layer's kernels built then ``kernel_warmup.py``. Progress leaves through ``callback(event, data)``;
nothing here prints. Under ``torchrun`` several processes train together (``parallel.py``: DDP or
FSDP2): batches are sharded by rank, so is validation under DDP, and only rank 0 logs and saves.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tformer_cli.batching import Batch, epoch_batches
from tformer_cli.config import Config, TrainConfig
from tformer_cli.devices import memory_mib, resolve_device
from tformer_cli.errors import DivergedError
from tformer_cli.kernel_warmup import build_training_kernels
from tformer_cli.optim import cosine_horizon, learning_rate
from tformer_cli.packing import training_batch
from tformer_cli.parallel import Workers, gathered, gradient_sync, local, optimizer_state
from tformer_cli.run_folder import CHECKPOINTS, WEIGHTS, holding, step_checkpoints
from tformer_cli.run_setup import Callback, Setup, TrainState
from tformer_cli.run_writer import writing
from tformer_cli.runs import StopSignals
from tformer_cli.runtime import checkpoint_folder, rng_state, save_checkpoint, save_run_files, save_weights
from tformer_cli.tensorboard import check_available as check_tensorboard
from tformer_cli.train_plan import Plan, plan_run


@dataclass
class TrainResult:
    run_dir: Path
    state: TrainState
    stop_reason: str
    last_eval: dict[str, Any] | None
    start: dict[str, Any]  # what the run announced at its start (``plan_run``)
    signal: int | None = None  # the signal that stopped training, if one did (here, or in another process)

    def summary(self) -> dict[str, Any]:
        """The run as it ends (the ``end`` event, which the closing table shows, and ``train --json``):
        steps, epochs, target tokens and their rate over all sessions, the best step, the last
        validation, and how it trained."""
        state = self.state
        how = {key: self.start[key] for key in SUMMARY_SETTINGS}
        return {"run_dir": str(self.run_dir), "stop_reason": self.stop_reason, "step": state.step,
                "epoch": state.epoch, "target_tokens": state.target_tokens, "elapsed": state.elapsed,
                "tokens_per_s": state.target_tokens / state.elapsed if state.elapsed else None,
                "best_step": state.best_step, "last_eval": self.last_eval, **how}


SUMMARY_SETTINGS = ("device", "processes", "precision", "compiled", "parameters")  # of TrainResult.start


def train(config: Config, run_dir: Path, resume: bool = False, callback: Callback | None = None,
          workers: Workers = Workers()) -> TrainResult:
    """Train ``config`` into ``run_dir`` (or continue the run there when ``resume``), as one of
    ``workers`` (see ``parallel.py``; by default the only process). The process that writes the run
    holds its folder meanwhile: another ``tformer train`` on it stops with one line."""
    with holding(run_dir) if workers.main else nullcontext():
        return _train(config, run_dir, resume, callback, workers)


def _train(config: Config, run_dir: Path, resume: bool, callback: Callback | None, workers: Workers) -> TrainResult:
    notify: Callback = callback if callback and workers.main else (lambda event, data: None)
    if config.train.tensorboard:
        check_tensorboard()  # before any data is loaded
    device = resolve_device(config.train.device)
    resume = resume and bool(step_checkpoints(run_dir))  # a run stopped before its first checkpoint starts anew
    signals = StopSignals()
    with signals.during_setup():
        setup = Setup(config, run_dir, resume, device, notify, workers)
    plan = plan_run(setup, notify)
    with signals.during_setup():  # set-up: a signal stops it at once, and the clocks start after it
        build_training_kernels(setup, plan.data, plan.batches)
    stop_reason, last_eval, stopped_by = _loop(setup, plan, signals, notify)
    setup.log.close()
    result = TrainResult(run_dir, setup.state, stop_reason, last_eval, plan.start, signals.received or stopped_by)
    notify("end", result.summary())
    return result


def _loop(setup: Setup, plan: Plan, signals: StopSignals, notify: Callback) -> tuple[str, dict | None, int | None]:
    """Train until a limit, early stopping or a signal: step after step, each in the order of this
    module's docstring. Returns why it stopped, the last validation's record and the stopping signal."""
    cfg, state, workers = setup.config.train, setup.state, setup.workers
    # a resumed run may already be at its limit
    stop_reason, last_eval = _stop_reason(cfg, state, state.batch_in_epoch >= len(plan.batches)), None
    stopped_by: int | None = None
    window = {"loss": 0.0, "tokens": 0, "start": time.perf_counter()}
    session_start, elapsed_before = time.perf_counter(), state.elapsed
    setup.trainer.train()
    # writes done on leaving; a failed one (a full disk) names the last intact checkpoint and how to resume
    with signals.between_steps(), writing(setup.run_dir), setup.writer.finishing():
        while stop_reason is None:
            while state.batch_in_epoch < len(plan.batches) and stop_reason is None:
                # batch: this process's share of one optimizer step, consecutive batches
                start = state.batch_in_epoch
                group = [training_batch(plan.data, ids, cfg.pack_length)
                         for ids in plan.batches[start:start + plan.accumulation]]
                group_tokens = sum(b.num_tokens for b in group)
                stopped_by = signals.received  # a signal stops training between two steps
                if workers.size > 1:  # the loss is normalised by every process's tokens; rank 0's clock rules
                    own_clock = elapsed_before + time.perf_counter() - session_start if workers.main else 0.0
                    group_tokens, clock, stopped_by = _agreed(workers, group_tokens, own_clock, stopped_by)
                if stopped_by is not None:
                    stop_reason = "interrupted"
                    break
                nll_sum, lr = _step(setup, group, group_tokens, plan.total_steps, plan.amp)
                state.step += 1
                state.batch_in_epoch += len(group)
                state.target_tokens += group_tokens
                state.elapsed = clock if workers.size > 1 else elapsed_before + time.perf_counter() - session_start
                window["loss"] += nll_sum
                window["tokens"] += group_tokens
                if state.step % cfg.log_every == 0:  # callback
                    _log(notify, setup, window, lr, plan)
                stop_reason = _stop_reason(cfg, state, state.batch_in_epoch >= len(plan.batches))
                paused = time.perf_counter()  # validation and checkpoints do not count in training tokens/s
                if setup.validates and (state.step % cfg.eval_every == 0 or stop_reason):  # evaluation
                    last_eval = _evaluate(setup, state, notify)
                    if cfg.patience and state.evals_without_improvement >= cfg.patience and not stop_reason:
                        stop_reason = f"no improvement in {cfg.patience} evaluations (early stopping)"
                if state.step % (cfg.save_every or cfg.eval_every) == 0 or stop_reason:  # checkpoint
                    _checkpoint(setup, notify)
                setup.best_copy = None  # a host copy of the weights on a GPU: not held until a later checkpoint
                window["start"] += time.perf_counter() - paused
            if state.batch_in_epoch >= len(plan.batches):
                state.epoch += 1
                state.batch_in_epoch = 0
                stop_reason = stop_reason or _stop_reason(cfg, state)
                if stop_reason is None:  # the next epoch's segmentation and batches
                    plan.data = setup.epoch_split()
                    plan.batches = epoch_batches(plan.data, cfg, state.epoch, workers.rank, workers.size)
        if stop_reason == "interrupted" and setup.saved_step != state.step:
            _checkpoint(setup, notify)  # at a step boundary, so that a resume continues exactly
    return stop_reason, last_eval, stopped_by


def _agreed(workers: Workers, group_tokens: int, own_clock: float,
            stopped_by: int | None) -> tuple[int, float, int | None]:
    """What every process takes for this step: the tokens of all their groups, rank 0's clock, and a
    stop signal that any of them got (on another machine, maybe), so that all stop at the same step."""
    total, clock, *got = workers.sum(group_tokens, own_clock, *(signum == stopped_by for signum in StopSignals.SIGNALS))
    return int(total), clock, next((signum for signum, n in zip(StopSignals.SIGNALS, got) if n), None)


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


def _log(notify: Callback, setup: Setup, window: dict, lr: float, plan: Plan) -> None:
    """The training figures since the last log (``window``), written to the metrics and called back; then
    the divergence check."""
    state, workers, flops = setup.state, setup.workers, plan.flops
    now = time.perf_counter()
    nll_sum, = workers.sum(float(window["loss"]))  # the one host sync per log interval; window tokens: all's
    loss = nll_sum / max(window["tokens"], 1)
    rate = window["tokens"] / max(now - window["start"], 1e-9)
    record = {"step": state.step, "epoch": state.epoch, "loss": loss, "ppl": math.exp(min(loss, 50)), "lr": lr,
              "tokens_per_s": rate, "tflops": rate * flops["per_token"] / 1e12, "elapsed": state.elapsed,
              "total_steps": plan.total_steps}
    if flops["peak"]:
        record["mfu"] = rate * flops["per_token"] / flops["peak"]
    record.update(memory_mib(setup.device))  # this process's; the GPU's peak includes validation since the last line
    if workers.main:
        setup.log.write("train", record)
    notify("step", record)
    window.update(loss=0.0, tokens=0, start=now)
    _check_finite(setup.model, state.step, workers, loss)


def _evaluate(setup: Setup, state: TrainState, notify: Callback) -> dict[str, Any]:
    """Validation loss (and BLEU when configured), on every process's share of the sentences under DDP
    or on rank 0; track the best weights and early stopping."""
    cfg, main = setup.config.train, setup.workers.main
    _check_finite(setup.model, state.step, setup.workers)  # NaN weights would be the first run's "best"
    notify("evaluating", {"step": state.step})
    model = setup.whole_model(state.step)
    if setup.validates_together:
        record = setup.validate(setup.model, state.step, together=True)
    else:
        record = setup.workers.from_main(setup.validate(model, state.step) if main else None)
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

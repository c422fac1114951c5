"""What a run will do before its first step: the epoch's batches, how many make a step, how many steps
the limits come to, and what a target token costs; announced to the callback as ``start``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tformer_cli.batching import batches_per_step, epoch_batches
from tformer_cli.config import TrainConfig
from tformer_cli.devices import autocast, fp16_would_be_faster, matmul_peak, slow_precision
from tformer_cli.encoding import EncodedSplit
from tformer_cli.errors import UsageError
from tformer_cli.optim import cosine_horizon, learning_rate
from tformer_cli.params import train_flops_per_token
from tformer_cli.run_setup import Callback, Setup, TrainState


@dataclass
class Plan:
    """What the loop walks: this epoch's split and its batches (ids of pairs), ``accumulation`` of which
    make a process's share of an optimizer step; the steps the run's limits come to (None: a time limit
    alone); the precision's autocast; what a target token costs (``_model_flops``); and what was
    announced as ``start`` (device, processes, precision, compiled, parameters, data)."""
    data: EncodedSplit
    batches: list[list[int]]
    accumulation: int
    total_steps: int | None
    amp: Any
    flops: dict[str, float | None]
    start: dict[str, Any]


def plan_run(setup: Setup, notify: Callback) -> Plan:
    """The run's batches and steps, announced (``start``) with what may surprise (a slow precision, a
    cosine schedule that rises on resuming). Raises UsageError if an epoch would make no step."""
    cfg, state, workers, device = setup.config.train, setup.state, setup.workers, setup.device
    data = setup.epoch_split()
    accumulation = batches_per_step(cfg, workers.size)
    _resume_in_batches_of_now(state, cfg, workers.size, accumulation)
    slow = slow_precision(device, setup.precision)
    if slow:
        notify("warning", {"message": f"train.precision {slow}; set train.precision=fp32"})
    if faster := fp16_would_be_faster(cfg.precision, device):
        notify("warning", {"message": f"train.precision {faster}: set train.precision=fp16 (or fp32, which "
                                      "trains as now without this warning)"})
    # this epoch's batches (0.4 s on a WMT-sized corpus)
    batches = epoch_batches(data, cfg, state.epoch, workers.rank, workers.size)
    first_epoch = batches if state.epoch == 0 else epoch_batches(data, cfg, 0, workers.rank, workers.size)
    if not first_epoch:  # else every epoch would end before its first step
        raise UsageError(no_step(cfg, len(data), workers.size, accumulation))
    steps_per_epoch = math.ceil(len(first_epoch) / accumulation)
    total_steps = _total_steps(cfg, steps_per_epoch)
    start = _start_info(setup, steps_per_epoch, accumulation, total_steps)
    notify("start", start)
    if rise := _cosine_restarted(setup, total_steps):
        notify("warning", {"message": rise})
    flops = _model_flops(setup, data, None if slow else matmul_peak(device, setup.precision))
    return Plan(data, batches, accumulation, total_steps, autocast(device, setup.precision), flops, start)


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


def no_step(cfg: TrainConfig, pairs: int, processes: int, accumulation: int) -> str:
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


def _start_info(setup: Setup, steps_per_epoch: int, batches_per_step: int, total_steps: int | None) -> dict[str, Any]:
    data = setup.train_data
    return {"run_dir": str(setup.run_dir), "device": str(setup.device), "processes": setup.workers.size,
            "precision": setup.precision, "compiled": setup.compiled, "resumed_at": setup.state.step,
            "parameters": sum(p.numel() for p in setup.model.parameters()), "train_pairs": len(data),
            "validation_pairs": len(setup.valid_data) if setup.valid_data else 0,
            "dropped_long": data.dropped_long, "dropped_empty": data.dropped_empty, "truncated": data.truncated,
            "steps_per_epoch": steps_per_epoch, "batches_per_step": batches_per_step, "total_steps": total_steps,
            "vocab_size": setup.vocab.tgt_size, "epoch": setup.state.epoch}


def _total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int | None:
    limits = [cfg.max_steps] if cfg.max_steps else []
    if cfg.epochs:
        limits.append(cfg.epochs * steps_per_epoch)
    return min(limits) if limits else None


def _model_flops(setup: Setup, data: EncodedSplit, peak: float | None) -> dict[str, float | None]:
    """What a target token of training costs in the model's matrix products (``train_flops_per_token``
    at this split's source tokens per target token), and the FLOP/s that all processes together
    could reach (``matmul_peak`` on each device; None where the precision is emulated)."""
    targets = data.tgt.offsets[-1].item() - len(data)  # the targets' tokens after <s>
    per_token = train_flops_per_token(setup.config.model, setup.vocab.tgt_size,
                                      data.src.offsets[-1].item() / max(targets, 1))
    return {"per_token": per_token, "peak": peak * setup.workers.size if peak else None}

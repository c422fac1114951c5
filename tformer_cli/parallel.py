"""Data-parallel training over the processes ``torchrun`` starts: one per GPU, or a few on a CPU.

    torchrun --standalone --nproc-per-node 4 -m tformer_cli train configs/base.yaml

Every process builds the same model from the same seed and trains on every N-th batch of each epoch;
the gradients are summed across processes (``GradientSync``), so all of them take the same optimizer
step: N processes with batches of ``max_tokens`` train as one process with ``grad_accum`` N. Each step's token count (the loss is normalised by the tokens of all
processes) and rank 0's clock (for ``max_time``) travel in one small all-reduce on the CPU, so the
processes agree on when to stop without waiting on the GPU. Rank 0 alone writes the run folder and
validates; the others receive its figures, so all agree on the best step and on early stopping.
Ranks other than 0 draw their dropout masks from (seed, rank, step), so a resumed run draws them again.

The model's own methods (``encode``, ``decode``) run the forward pass, not ``forward``, so torch's
DistributedDataParallel, whose gradient hooks are armed by ``forward``, does not fit; ``GradientSync``
does its part here: buckets of gradients are summed while the backward pass goes on.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tformer_cli.errors import TformerError


@dataclass(frozen=True)
class Workers:
    """This process's place among the training processes (one process: rank 0 of 1)."""

    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            with self.together():
                dist.barrier()

    def sum(self, *values: float) -> list[float]:
        """Each value summed over the processes (on the CPU: no wait on a GPU)."""
        if self.size == 1:
            return list(values)
        totals = torch.tensor(values, dtype=torch.float64)
        with self.together():
            dist.all_reduce(totals)
        return totals.tolist()

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object), on every process."""
        if self.size == 1:
            return value
        box = [value]
        with self.together():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    @contextmanager
    def together(self):
        """A collective that fails because another process stopped is one line here, not a traceback
        on every other process (the process that stopped prints the cause)."""
        try:
            yield
        except RuntimeError as exc:  # gloo and NCCL raise RuntimeError and its subclasses
            raise TformerError(f"process {self.rank}: another training process stopped ({type(exc).__name__}); "
                               "its own error says why") from exc


class GradientSync:
    """Sums the gradients over the processes while the backward pass is still running.

    Parameters are grouped into buckets of about ``bucket_mb`` MiB, in reverse order of definition
    (roughly the order in which backward finishes their gradients). During the backward pass of a
    step's last batch (``arm``) a hook counts each finished gradient; a full bucket is copied into a
    flat buffer and its all-reduce starts at once, in the background, while backward goes on. Buckets
    start in index order on every process, whatever order their gradients finish in, so the
    processes' collectives always match. ``finish`` starts what is left, waits and copies the sums
    back. One process: every method does nothing.
    """

    def __init__(self, workers: Workers, parameters, bucket_mb: float = 25.0) -> None:
        self.workers = workers
        self.armed = False
        self.hooks, self.buckets, self.bucket_of = [], [], {}
        if workers.size == 1:
            return
        params = list({id(p): p for p in parameters if p.requires_grad}.values())  # tied weights once
        bucket, size = [], 0
        for p in reversed(params):
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_mb * 2**20:
                self.buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.hooks = [p.register_post_accumulate_grad_hook(self._finished) for p in params]
        self._reset()

    def arm(self) -> None:
        """The next backward pass completes this step's gradients: sum them as they finish."""
        self.armed = self.workers.size > 1

    def finish(self) -> None:
        """Every parameter's gradient summed over the processes, in place (None counts as zeros)."""
        if self.workers.size == 1:
            return
        self.waiting = [0] * len(self.buckets)
        self._start_ready()
        with self.workers.together():
            for work in self.pending:
                work.wait()
        for bucket, flat in zip(self.buckets, self.flats):
            grads = [p.grad for p in bucket]
            for grad, summed in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(summed.view_as(grad))
        self._reset()

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def _reset(self) -> None:
        self.armed = False
        self.waiting = [len(bucket) for bucket in self.buckets]  # gradients each bucket still waits for
        self.started = 0  # buckets started, in index order
        self.pending, self.flats = [], []

    def _finished(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        i = self.bucket_of[id(param)]
        self.waiting[i] -= 1
        if self.waiting[i] == 0:
            self._start_ready()

    def _start_ready(self) -> None:
        while self.started < len(self.buckets) and self.waiting[self.started] == 0:
            bucket = self.buckets[self.started]
            for p in bucket:
                if p.grad is None:  # not used this step: it contributes zeros
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            with self.workers.together():
                self.pending.append(dist.all_reduce(flat, async_op=True))
            self.flats.append(flat)
            self.started += 1


def join(device: torch.device) -> Workers:
    """Join the process group ``torchrun`` describes in the environment (WORLD_SIZE > 1): NCCL for the
    gradients on CUDA, one GPU per process (LOCAL_RANK), and gloo for the CPU's small messages."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return Workers()
    if not dist.is_initialized():
        if device.type == "cuda":
            gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(gpu)
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=gpu)
        else:
            dist.init_process_group("gloo")
    return Workers(dist.get_rank(), size)


def leave() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

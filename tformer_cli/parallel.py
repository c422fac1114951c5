"""Data-parallel training over the processes ``torchrun`` starts: one per GPU, or a few on a CPU.

    torchrun --standalone --nproc-per-node 4 -m tformer_cli train configs/base.yaml

Every process builds the same model from the same seed and trains on every N-th batch of each epoch;
after the backward pass the gradients are summed across processes in one all-reduce of a flat buffer,
so all of them take the same optimizer step: N processes with batches of ``max_tokens`` train as one
process with ``grad_accum`` N. Each step's token count (the loss is normalised by the tokens of all
processes) and rank 0's clock (for ``max_time``) travel in one small all-reduce on the CPU, so the
processes agree on when to stop without waiting on the GPU. Rank 0 alone writes the run folder and
validates; the others receive its figures, so all agree on the best step and on early stopping.
Ranks other than 0 draw their dropout masks from (seed, rank, step), so a resumed run draws them again.

The model's own methods (``encode``, ``decode``) run the forward pass, not ``forward``, so torch's
DistributedDataParallel, whose gradient hooks are armed by ``forward``, does not fit; the price of
the plain all-reduce is that it starts after the backward pass instead of overlapping with it.
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
            with self._together():
                dist.barrier()

    def sum(self, *values: float) -> list[float]:
        """Each value summed over the processes (on the CPU: no wait on a GPU)."""
        if self.size == 1:
            return list(values)
        totals = torch.tensor(values, dtype=torch.float64)
        with self._together():
            dist.all_reduce(totals)
        return totals.tolist()

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object), on every process."""
        if self.size == 1:
            return value
        box = [value]
        with self._together():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum_gradients(self, parameters) -> None:
        """Sum every parameter's gradient over the processes, in place, in one all-reduce."""
        if self.size == 1:
            return
        grads = [p.grad for p in parameters if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        with self._together():
            dist.all_reduce(flat)
        for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(summed)

    @contextmanager
    def _together(self):
        """A collective that fails because another process stopped is one line here, not a traceback
        on every other process (the process that stopped prints the cause)."""
        try:
            yield
        except RuntimeError as exc:  # gloo and NCCL raise RuntimeError and its subclasses
            raise TformerError(f"process {self.rank}: another training process stopped ({type(exc).__name__}); "
                               "its own error says why") from exc


def launched_rank() -> int:
    """This process's rank as ``torchrun`` set it (0 when not launched by it), before joining."""
    return int(os.environ.get("RANK", "0"))


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

"""Training on several processes with PyTorch's own engines, launched by ``tformer train --nproc-per-node``
on one machine or many (``launch.py``), or by ``torchrun``.

    tformer train configs/base.yaml --nproc-per-node 4
    tformer train configs/base.yaml --nproc-per-node 8 --nnodes 2 --rdzv-endpoint HOST:PORT   # on each machine

Every process builds the same model and trains on its share of each step: every N-th batch of the
epoch, or with ``train.step_tokens`` its batches of a step cut for all of them
(``batching.shared_out``), which makes the steps the same on any number of processes.
``train.parallel`` picks the engine that keeps the processes' weights equal:

- ``ddp``: ``DistributedDataParallel``. Every process holds the whole model; gradients are averaged in
  buckets that start while the backward pass is still running.
- ``fsdp``: FSDP2 (``fully_shard``). Each encoder and decoder layer's weights, gradients and Adam state
  are split across the processes and gathered layer by layer for forward and backward, for models
  whose weights and optimizer state do not fit on one device.

Either way the loss is normalised by all processes' target tokens, so N processes take the steps one
process takes with ``grad_accum`` N (with ``train.step_tokens``, the steps one process takes). Each
step's token count and rank 0's clock (for ``max_time``) travel in one small all-reduce on the CPU
(``Workers.sum``) with the signals that reached any of them, so the processes agree on when to stop,
and why, without waiting on a GPU. Rank 0 alone writes the run folder. Under DDP every process
validates a share (every N-th batch and sentence: ``Workers.sum``, ``Workers.gather``); under FSDP
rank 0 validates the gathered weights and the others receive its figures. Either way all agree on the
best step and on early stopping. Checkpoints hold whole tensors (``gathered``), so a run resumes on
any number of processes.
"""

from __future__ import annotations

import gc
import os
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._pytree import tree_map_only

from tformer_cli.errors import TformerError, UsageError
from tformer_cli.launch import torchrun_variable

# How long a process waits in a collective for the others: long enough for rank 0 to validate with BLEU
# while the others wait for its figures (FSDP), short enough that a process stuck without a peer ends.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
left_group = False  # set by ``leave``: a successful process then ends through ``end_process``


@dataclass(frozen=True)
class Workers:
    """This process's place among the training processes (one process: rank 0 of 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0  # among the processes of this node
    grouped: bool = False  # in a process group (``join``): the model trains under DDP or FSDP, even alone

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.grouped:
            with self.together():
                dist.barrier()

    def sum(self, *values: float) -> list[float]:
        """Each value summed over the processes (on the CPU: no wait on a GPU)."""
        if not self.grouped:
            return list(values)
        totals = torch.tensor(values, dtype=torch.float64)
        with self.together():
            dist.all_reduce(totals)
        return totals.tolist()

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object), on every process."""
        if not self.grouped:
            return value
        box = [value]
        with self.together():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def tensors_from_each(self, tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Every process's ``tensors`` (on the CPU, by name), in rank order, on every process: sent as
        they are, where ``gather`` would pickle them (a WMT-sized split of ~2.4 GB: seconds, not tens of
        seconds)."""
        if not self.grouped:
            return [tensors]
        layouts = self.gather({name: (t.shape, t.dtype) for name, t in tensors.items()})
        received = [{name: t.contiguous() for name, t in tensors.items()} if rank == self.rank else
                    {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in layout.items()}
                    for rank, layout in enumerate(layouts)]
        with self.together():
            for rank, part in enumerate(received):
                for tensor in part.values():
                    dist.broadcast(tensor, src=rank)
        return received

    def gather(self, value: Any) -> list[Any]:
        """Every process's ``value`` (any picklable object), in rank order, on every process."""
        if not self.grouped:
            return [value]
        values: list[Any] = [None] * self.size
        with self.together():
            dist.all_gather_object(values, value)
        return values

    @contextmanager
    def together(self):
        """A collective that fails because another process stopped is one line here, not a traceback
        on every other process (the process that stopped prints the cause)."""
        if not self.grouped:
            yield
            return
        try:
            yield
        except torch.OutOfMemoryError:  # this process's own failure: the CLI says which setting to lower
            raise
        except RuntimeError as exc:  # gloo and NCCL raise RuntimeError and its subclasses
            raise TformerError(f"process {self.rank}: another training process stopped ({type(exc).__name__}); "
                               "its own error says why") from exc


def distribute(objective: nn.Module, layers: list[nn.Module], workers: Workers, engine: str,
               device: torch.device) -> nn.Module:
    """``objective`` (the module whose forward computes the loss) ready to train on ``workers``: as it
    is for one process, wrapped in DDP, or sharded by FSDP2 ``layers`` first and then the rest (the
    embeddings, output projection and final norms, gathered once per step)."""
    if not workers.grouped:
        return objective
    if engine == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # the mesh names the training device: left to itself, FSDP2 shards onto CUDA wherever there is a GPU
        # (pytorch/pytorch#132471)
        mesh = init_device_mesh(device.type, (workers.size,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(objective, mesh=mesh)
    from torch.nn.parallel import DistributedDataParallel

    # the model's buffers are constants (positions, ALiBi slopes): no need to broadcast them every step;
    # gradients live in DDP's buckets, saving a copy of them each way
    return DistributedDataParallel(objective, device_ids=[torch.cuda.current_device()] if device.type == "cuda" else None,
                                   forward_sync_buffers=False, gradient_as_bucket_view=True)


def gradient_sync(trainer: nn.Module, last: bool):
    """Within this block the backward pass syncs gradients across processes only if ``last`` (the last
    micro-batch of a step): earlier ones accumulate locally, as ``grad_accum`` wants."""
    if hasattr(trainer, "no_sync"):  # DDP
        return nullcontext() if last else trainer.no_sync()
    if hasattr(trainer, "set_requires_gradient_sync"):  # FSDP2
        trainer.set_requires_gradient_sync(last)
    return nullcontext()


def gathered(tree: Any) -> Any:
    """``tree`` (a tensor, or dicts and lists of them) with every sharded tensor made whole. A
    collective under FSDP: every process calls it, in the same order. Without sharding, ``tree`` itself."""
    return tree_map_only(DTensor, lambda t: t.full_tensor(), tree)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a sharded tensor; the tensor itself if it is not sharded."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_like(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``whole`` (a saved full tensor) split the way ``param`` is, when ``param`` is sharded and the
    shapes agree (Adam's moments); anything else as it is (a step count)."""
    if isinstance(param, DTensor) and whole.shape == param.shape:
        return distribute_tensor(whole.to(param.device), param.device_mesh, param.placements)
    return whole


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state with whole tensors: the same on any number of processes (a collective
    under FSDP)."""
    return gathered(optimizer.state_dict())


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load a state from ``optimizer_state``, split the way this process's parameters are."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {index: {key: shard_like(value, params[int(index)]) if isinstance(value, torch.Tensor) else value
                     for key, value in entry.items()}
             for index, entry in saved["state"].items()}
    optimizer.load_state_dict({**saved, "state": state})


def join(device: torch.device, engine: str = "ddp") -> Workers:
    """Join the process group ``torchrun`` describes in the environment (WORLD_SIZE > 1): NCCL for the
    gradients on CUDA, one GPU per process (LOCAL_RANK), and gloo for the CPU's small messages (and for
    everything when a node runs more processes than it has GPUs: DDP only)."""
    size = torchrun_variable("WORLD_SIZE")
    if size == 1:
        return Workers()
    if not dist.is_initialized():
        if device.type == "cuda":
            gpus, local = torch.cuda.device_count(), torchrun_variable("LOCAL_RANK")
            gpu = torch.device("cuda", local % gpus)
            torch.cuda.set_device(gpu)
            # NCCL wants a GPU of its own per process; more processes than GPUs share them over gloo
            processes = torchrun_variable("LOCAL_WORLD_SIZE")
            shared = processes > gpus
            # FSDP there: sharding saves nothing, and FSDP2 over gloo crashed on CUDA (pytorch/pytorch#132471)
            if shared and engine == "fsdp":
                raise UsageError(f"train.parallel=fsdp needs a GPU per process, and this node runs {processes} "
                                 f"processes on {gpus} GPU(s): run --nproc-per-node {gpus}, or train.parallel=ddp")
            backend = "cpu:gloo,cuda:gloo" if shared else "cpu:gloo,cuda:nccl"
            dist.init_process_group(backend, device_id=None if shared else gpu, timeout=COLLECTIVE_TIMEOUT)
        else:
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    return Workers(dist.get_rank(), size, torchrun_variable("LOCAL_RANK"), grouped=True)


def leave() -> None:
    """Leave the process group, if this process joined one. The DDP or FSDP wrappers' reference cycles
    (they hold the group and tensors its threads may still release) are collected first, while the
    interpreter is whole."""
    global left_group
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        left_group = True


def end_process() -> NoReturn:
    """End a process that left its process group after a successful command (exit status 0), skipping
    the interpreter's teardown: gloo's threads can still drop the last reference to a tensor then, and
    taking the GIL during finalization aborts the process (SIGABRT, "terminate called without an active
    exception"; pytorch/pytorch#190489), so that torchrun would report a finished run as failed.
    Everything tformer writes is closed by now. A failing process ends as usual: its teardown leaves
    the others time to see the group break and say so, before torchrun stops them."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

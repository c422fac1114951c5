"""Writing a run's checkpoints while training goes on.

A checkpoint of base is ~0.7 GB (weights and Adam's two moments): serialising and writing it held
the training loop 0.95-2.0 s on a 2-core EPYC (benchmarks/README.md), time a GPU would spend idle
every ``train.save_every`` steps, and again for the best weights at each validation. On a GPU the
writes run on one thread beside training instead, from copies on the host taken at the step they
belong to (the loop then held 0.03-0.2 s), in the order they were handed over; every file is still
written under a temporary name and renamed into place (``files.replacing``). On a CPU they run at
once, where the copies would add a checkpoint's size to the process's memory.

A write that fails is raised at the next hand-over, or when training ends; a run always waits for
its writes before it returns. Training's "checkpoint" event is a job of its own, after the files': it
is sent once they are on disk (on a GPU, from the writer's thread).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from tformer_cli.errors import CheckpointError
from tformer_cli.files import WriteFailed
from tformer_cli.run_folder import start_again, step_checkpoints
from tformer_cli.runtime import unwrapped


def writes_in_background(device: torch.device) -> bool:
    """Whether training on ``device`` writes its checkpoints beside training: on GPUs."""
    return device.type == "cuda"


class RunWriter:
    """Runs write jobs in the order they are handed over: on a thread of their own (``background``),
    or at once."""

    def __init__(self, background: bool) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tformer-writer") if background else None
        self._jobs: list[Future] = []

    @property
    def background(self) -> bool:
        return self._pool is not None

    def frozen(self, tree: Any) -> Any:
        """``tree`` (tensors in dicts and lists) as it is now, for a job: copies on the host when the job
        runs later, the tree itself when it runs at once. Tensors that share memory (tied weights)
        share their copy, so safetensors still stores them once."""
        if not self.background:
            return tree
        copies: dict[tuple, torch.Tensor] = {}

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
            if key not in copies:
                copies[key] = tensor.detach().to("cpu", copy=True)
            return copies[key]

        return tree_map_only(torch.Tensor, copy, tree)

    def weights(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model``'s weights as they are now, as a module that ``runtime.save_weights`` writes."""
        return FrozenWeights(self.frozen(unwrapped(model).state_dict())) if self.background else model

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` after the jobs handed over before it; first raise the failure of one that ended."""
        self._raise_failed([handed for handed in self._jobs if handed.done()])
        if not self.background:
            job()
            return
        self._jobs.append(self._pool.submit(job))

    def wait(self) -> None:
        """Wait for every job handed over; raise the first that failed."""
        jobs, self._jobs = self._jobs, []
        wait(jobs)
        self._raise_failed(jobs)

    @contextmanager
    def finishing(self) -> Iterator[None]:
        """Every job handed over inside the block is done when it is left, also when the block raises
        (then a failed write does not hide the error that stopped it); the thread ends with it."""
        try:
            yield
        except BaseException:
            wait(self._jobs)
            self._jobs = []
            raise
        else:
            self.wait()
        finally:
            if self.background:
                self._pool.shutdown()

    def _raise_failed(self, done: list[Future]) -> None:
        self._jobs = [job for job in self._jobs if job not in done]
        for job in done:
            job.result()


@contextmanager
def writing(run_dir: Path) -> Iterator[None]:
    """A failed write of the run (a full disk, say) names the checkpoint that is intact and how to resume."""
    try:
        yield
    except WriteFailed as exc:
        last = step_checkpoints(run_dir)
        if last:
            then = f"the last checkpoint, {last[-1].name}, is intact: {exc.fix}, then resume with tformer train " \
                   f"--resume {run_dir}"
        else:
            then = f"no checkpoint was written yet: {exc.fix}, then start it again with {start_again(run_dir)}"
        raise CheckpointError(f"{exc.what}; {then}") from exc


class FrozenWeights(torch.nn.Module):
    """Weights copied from a model, standing in for it where ``safetensors.torch.save_model`` reads
    ``state_dict()`` (and drops the names of tied matrices but one)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.weights = weights

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # noqa: ARG002
        return dict(self.weights)

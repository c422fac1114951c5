"""For benchmarks/gpu.sh only, on a GPU image whose torch predates tformer's range (2.11 there, with no
internet to install 2.13): DistributedDataParallel took ``broadcast_buffers`` before torch named it
``forward_sync_buffers``. gpu.sh puts this folder on PYTHONPATH for such a torch, and Python imports
``sitecustomize`` at start-up in every process, the test's spawned workers included."""

import inspect

from torch.nn.parallel import DistributedDataParallel


def _taking_forward_sync_buffers(init):  # noqa: ANN001, ANN202
    def __init__(self, *args, forward_sync_buffers=True, **kwargs):  # noqa: ANN001, ANN202
        kwargs.setdefault("broadcast_buffers", forward_sync_buffers)
        init(self, *args, **kwargs)

    return __init__


if "forward_sync_buffers" not in inspect.signature(DistributedDataParallel.__init__).parameters:
    DistributedDataParallel.__init__ = _taking_forward_sync_buffers(DistributedDataParallel.__init__)

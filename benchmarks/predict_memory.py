"""Predict each system's peak training memory at the paper's scale without a GPU: the suite's
paper-scale steps (``systems.paper_batches``) under bf16 autocast, run on fake tensors (shapes and
dtypes, no data, nothing computed), counting the bytes of every tensor storage while it lives.

    python benchmarks/predict_memory.py                         # base and big, tformer and every training peer
    python benchmarks/predict_memory.py --sizes base --tokens 25000 --systems tformer,marian
    python benchmarks/predict_memory.py --systems tformer --explicit-attention --bf16-stream   # its experiments

What it counts is what ``torch.cuda.max_memory_allocated`` counts in the suite's ``memory`` workload
(parameters, gradients, AdamW's state, activations saved for the backward pass, temporaries), without
the CUDA allocator's rounding, with CPU autocast's op lists (close to CUDA's) and the CPU's choice of
attention kernel. tformer runs its plain model, as on a GPU, where the speed layer swaps no module,
and its loss forms the logits of 8,192 rows at a time, as on a GPU, in fp32 (the plain path's: the
speed layer's GPU loss keeps them in bf16, so this errs high).
Compiled systems cannot be predicted this way (inductor allocates inside its own code).
"""

from __future__ import annotations

import argparse
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import systems  # noqa: E402
from tformer_cli import loss  # noqa: E402

# tformer and the training peers (the memory workload's systems), by their --peers keys
TRAINING = {"tformer": systems.Tformer, **{key: peer for key, peer in systems.PEERS.items()
                                           if not key.startswith("tformer") and peer.supports_train}}


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that ops create, while they live, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._count(tensor.untyped_storage())
        return out

    def _count(self, storage) -> None:  # noqa: ANN001
        key = storage._cdata
        if key in self.live:  # a view, or an op that wrote into its input
            return
        self.live[key] = storage.nbytes()
        self.now += self.live[key]
        self.peak = max(self.peak, self.now)
        self.refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)
        self.refs.pop(key, None)


def predict(system_key: str, size: systems.Size, batches: list[systems.TrainBatch],
            experiments: Sequence[Callable[[torch.nn.Module], None]] = ()) -> float:
    """Peak MiB of one system training on ``batches``, a step each; tformer's model changed by each of
    ``experiments`` first (profile_step.py's ``explicit_attention``, ``bf16_stream``)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        system = TRAINING[system_key](size, torch.device("cpu"), fused=True)  # the suite's memory workload
        for experiment in experiments if system_key == "tformer" else ():
            experiment(system.model)
        parameters = sum(p.numel() * p.element_size() for p in system.model.parameters())
        with LiveBytes() as live:
            for batch in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    system.train_step(batch)
    return (parameters + live.peak) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="base,big")
    parser.add_argument("--systems", default=",".join(TRAINING), help=f"of {','.join(TRAINING)}")
    parser.add_argument("--tokens", type=systems.at_least(64), default=25_000,
                        help="target tokens a step (the suite's --paper-tokens)")
    parser.add_argument("--steps", type=systems.at_least(1), default=6, help="the suite's --paper-steps")
    parser.add_argument("--sentences", type=systems.at_least(1),
                        help="instead, the suite's fixed step at the default scale: this many sentences of 24 "
                             "tokens, 3 steps")
    parser.add_argument("--explicit-attention", action="store_true",
                        help="tformer's attention through its explicit path (profile_step.py's --compile-attention "
                             "explicit)")
    parser.add_argument("--bf16-stream", action="store_true",
                        help="tformer's residual stream in bf16 (profile_step.py --bf16-stream)")
    args = parser.parse_args()
    from profile_step import bf16_stream, explicit_attention

    experiments = [explicit_attention] * args.explicit_attention + [bf16_stream] * args.bf16_stream
    for option, given, known in (("--sizes", args.sizes, systems.SIZES), ("--systems", args.systems, TRAINING)):
        unknown = sorted(set(given.split(",")) - set(known))
        if unknown:
            parser.error(f"{option}: unknown {', '.join(unknown)} (choose from {', '.join(known)})")
    warnings.filterwarnings("ignore")  # fake tensors warn where the loss checks data pointers
    systems.ACCEL = "off"
    loss.CHUNK_TOKENS = loss.GPU_CHUNK_TOKENS  # tformer's loss forms logits as many rows at a time as on a GPU
    # modules built under fake tensors are already where they run; .to() would try to swap tied parameters
    torch.nn.Module.to = lambda self, *a, **k: self
    for size_name in args.sizes.split(","):
        size, cpu = systems.SIZES[size_name], torch.device("cpu")
        batches = ([systems.make_batch(size, args.sentences, 24, cpu)] * 3 if args.sentences
                   else systems.paper_batches(size, args.tokens, args.steps, cpu))
        peaks = {key: predict(key, size, batches, experiments) for key in args.systems.split(",")}
        for key, peak in peaks.items():
            print(f"{size_name:5} {key:{max(map(len, TRAINING))}} {peak:9,.0f} MiB")
        peers = {key: peak for key, peak in peaks.items() if key != "tformer"}
        if "tformer" in peaks and peers:
            lowest = min(peers, key=peers.get)
            print(f"{size_name:5} tformer / the lowest peer ({lowest}): {peaks['tformer'] / peers[lowest]:.2f}x")


if __name__ == "__main__":
    main()

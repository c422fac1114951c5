"""The speed layer: faster CPU kernels swapped into the plain model by one function, ``accelerate``.

The model in ``tformer_cli.model`` is the paper and nothing else; what exists only for speed is here,
tested equal to the plain path (tests/test_accel*.py), and turned off by ``train.accel: off`` or
``--accel off``. On a CPU, ``accelerate`` swaps in:

- ``FastLinear`` / ``FastFeedForward`` (linear.py): decoding multiplies by weights packed for oneDNN,
  the FFN's activation fused into its first product;
- fp32 products on oneDNN where torch's BLAS is slow (gemm.py: x86 CPUs with AVX-512 not made by Intel), also
  in the fused loss;
- ``FastDropout`` (dropout.py): masks from SplitMix64 words instead of a Mersenne Twister per element;
- ``CpuAttention`` (attention.py): each attention call to the fastest of torch's CPU kernels;
- process settings (``tune_runtime``): glibc keeps freed buffers, oneDNN keeps more kernels;
- before training, the kernels it would otherwise compile as it goes, side by side: those of
  validation's decoding (``build_decoding_kernels``) and, where products run on oneDNN, those of the
  training step (``build_kernels``); the training loop calls both;
- with ``int8``, int8 linear layers for decoding (int8.py).

A compiled run (``train.compile``) trains without the swapped-in modules (``MODULE_PIECES``):
torch.compile fuses the plain model's own.

Decoding's argmax and top-k by blocks (search.py) are not swapped in: they return torch's own results,
faster on a CPU, whatever the mode.

On a GPU torch's own kernels are the fast ones and nothing is swapped; the fused loss computes its
softmax and logit gradient in one compiled pass instead of several (fused_loss.py), and greedy and
beam search replay each step as one CUDA graph (graphs.py).
What each piece buys, measured: benchmarks/README.md.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tformer_cli.accel import fused_loss, gemm, graphs, heap
from tformer_cli.accel.attention import CpuAttention
from tformer_cli.accel.dropout import FastDropout
from tformer_cli.accel.gemm import build_kernels
from tformer_cli.accel.int8 import quantize_int8
from tformer_cli.accel.linear import FastFeedForward, FastLinear, build_decoding_kernels
from tformer_cli.config import check_accel_mode
from tformer_cli.errors import UsageError
from tformer_cli.model.attention import ScaledDotProductAttention
from tformer_cli.model.layers import PositionwiseFeedForward

__all__ = ["PIECES", "CUDA_PIECES", "accelerate", "build_decoding_kernels", "build_kernels",
           "tune_runtime", "widen_kernel_cache"]
# what ``skip`` may leave out, to measure each
PIECES = ("linear", "gemm", "dropout", "attention", "runtime", "loss", "graphs")
CUDA_PIECES = ("loss", "graphs")  # the pieces that act on a GPU; the others act on a CPU
# the pieces that swap CPU modules into the model; a compiled run (train.compile) leaves them out and
# torch.compile fuses the plain model's own: through them it made 29 graphs that recompiled for each new
# batch shape (FastDropout's random_ breaks the graph, the products' padded rows specialise it on token
# counts; benchmarks/README.md, "train.compile on a CPU")
MODULE_PIECES = ("linear", "dropout", "attention")
ONEDNN_CACHE_CAPACITY = 4096  # a bf16 Multi30k run used ~1,700; each kernel holds ~0.5-2.5 MB


def accelerate(model: nn.Module, device: torch.device | str, mode: str = "auto",
               skip: tuple[str, ...] = (), int8: bool = False, compiled: bool = False) -> nn.Module:
    """Swap the speed layer into ``model`` for ``device`` (in place; the model is returned). The
    swapped modules hold the model's own parameters, so tied weights stay tied and the state dict keeps
    its keys. ``mode`` "off" leaves the model plain (and torch's own products in the fused loss);
    ``skip`` leaves out some of ``PIECES`` (the benchmark measures what each buys). ``int8`` (CPU
    decoding, ``--precision int8``) gives every linear layer int8 weights, with either mode; ``compiled``
    (a model that ``train.compile`` compiles) leaves out the modules of ``MODULE_PIECES``. The
    switches of the oneDNN products (CPU), the fused loss and the decoding graphs (CUDA) are the
    process's, one set per kind of device: the model last accelerated for a kind of device sets them."""
    check_accel_mode(mode)
    unknown = set(skip) - set(PIECES)
    if unknown:
        raise UsageError(f"accel pieces {', '.join(sorted(unknown))}: choose from {', '.join(PIECES)}")
    if int8:
        quantize_int8(model)
        skip = (*skip, "linear")
    if compiled:
        skip = (*skip, *MODULE_PIECES)
    # only this kind of device's switches: a CPU model loaded beside a GPU one leaves the GPU's as they were
    kind, on = torch.device(device).type, mode == "auto"
    if kind == "cpu":
        gemm.enable(on and "gemm" not in skip and gemm.pays_here())
        if on and "runtime" not in skip:
            tune_runtime()
        if on:
            _swap(model, set(skip))
    elif kind == "cuda":
        from tformer_cli.devices import compile_unsupported

        # the fused loss is compiled: where it cannot be, the plain loss, without the warning of a failed compile
        fused_loss.enable(on and "loss" not in skip and compile_unsupported(torch.device(device)) is None)
        graphs.enable(on and "graphs" not in skip)
    return model


def _swap(module: nn.Module, skip: set[str]) -> None:
    for name, child in module.named_children():
        if isinstance(child, PositionwiseFeedForward) and "linear" not in skip:
            setattr(module, name, FastFeedForward(child).train(child.training))
        elif type(child) is nn.Linear and "linear" not in skip:
            setattr(module, name, FastLinear.of(child))
        elif type(child) is nn.Dropout and "dropout" not in skip:
            setattr(module, name, FastDropout(child.p).train(child.training))
        elif type(child) is ScaledDotProductAttention and "attention" not in skip:
            setattr(module, name, CpuAttention().train(child.training))
        else:
            _swap(child, skip)


def tune_runtime() -> None:
    """The process-wide CPU settings that training and decoding want, applied before their first
    step: the allocator keeps freed buffers, and oneDNN keeps a kernel for every shape it meets."""
    heap.keep_freed_buffers()
    widen_kernel_cache()


def widen_kernel_cache() -> None:
    """Let oneDNN keep 4,096 compiled matrix-product kernels instead of 1,024 (unless the user set
    ONEDNN_PRIMITIVE_CACHE_CAPACITY); it takes effect before the process's first oneDNN product. oneDNN
    builds a kernel for every shape, and batches of varying lengths bring new shapes: with the default
    a bf16 run's cache thrashed and training slowed as the run went on. Each kernel holds memory, so
    the cap also bounds what the cache can take (benchmarks/README.md)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))

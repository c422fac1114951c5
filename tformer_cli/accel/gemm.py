"""fp32 matrix products on oneDNN, on CPUs where it beats torch's default BLAS.

Torch multiplies fp32 matrices on a CPU with MKL, and MKL does not run its AVX-512 kernels on AMD
CPUs, where oneDNN, which torch also ships, is about twice as fast. So on x86 CPUs with AVX-512 not
made by Intel, ``linear`` runs on oneDNN, its gradients too (``_Linear``), as do the fused loss's
vocabulary products. Elsewhere (Intel CPUs, and AMD CPUs without AVX-512, where MKL's AVX2 kernels
are as fast as oneDNN's and need no compiled kernel per shape), under autocast (whose bf16 products
torch already sends to oneDNN), for small products and off the CPU it is ``F.linear``.

oneDNN's entry point is torch's ``mkldnn._linear_pointwise`` (behind torch.compile's CPU linear
layers): x @ w^T for a row-major x and a w of any strides, so a product with a transposed factor
passes the transpose as a view. Only its first operand is copied when not row-major. oneDNN compiles
and keeps a kernel for every shape it meets, so rows are padded with zeros to a few sizes
(``padded_rows``): a Multi30k epoch's 25 row counts become 7. Measurements behind these choices:
benchmarks/README.md.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from tformer_cli.accel import heap
from tformer_cli.accel.ops import LINEAR_POINTWISE

# Below about a million multiply-adds MKL's smaller call overhead wins (benchmarks/README.md)
MIN_PRODUCT = 2**20
# oneDNN compiles and keeps a kernel (~0.6 MB) for every row count it multiplies, and training's batches
# bring dozens (sentences x positions): rows are padded with zeros to one of 16 sizes per power of two,
# a multiple of ROW_MULTIPLE at least (``padded_rows``)
ROW_MULTIPLE = 64
_enabled = False  # set by ``enable`` (``accelerate`` calls it): fp32 products go to oneDNN
_recording: set | None = None  # while ``build_kernels`` looks for shapes: the products' signatures


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., k) @ weight (n, k)^T + bias on oneDNN."""
    if _recording is not None:  # a pass of build_kernels: what oneDNN would be asked, not the product
        _recording.add((tuple(x.shape), x.stride(), tuple(weight.shape), weight.stride(), bias is not None))
        return x.new_zeros(*x.shape[:-1], weight.shape[0])
    return LINEAR_POINTWISE(x, weight, bias, "none", [], "")


def build_kernels(passes: Iterable[Callable[[], object]]) -> int:
    """Compile now, side by side at the bottom of the heap, the kernels of every product that
    ``passes`` make (training: one forward and backward per batch shape); returns how many.

    oneDNN compiles a kernel for each product shape and keeps it, with ~0.6 MB of heap. Built as
    training meets new shapes, the kernels land between the step's buffers and pin the heap around
    them: a Multi30k run held 1.7 GB where one with these kernels built first held 1.25
    (benchmarks/README.md). The passes run with every product replaced by zeros, and the random
    number generator is left as it was, so a resumed run draws what it would have. Passes and
    compiling took 25 s before a Multi30k run on a Zen 3 CPU, whose 20th step came 21 s later."""
    global _recording
    if not _enabled:
        return 0
    _recording = signatures = set()
    try:
        with torch.random.fork_rng(devices=[]):
            for run in passes:
                run()
    finally:
        _recording = None
    with heap.compact():
        for x_shape, x_stride, w_shape, w_stride, has_bias in sorted(signatures):
            x = torch.empty_strided(x_shape, x_stride).zero_()
            weight = torch.empty_strided(w_shape, w_stride).zero_()
            _onednn(x, weight, weight.new_zeros(w_shape[0]) if has_bias else None)
    return len(signatures)


def enable(on: bool) -> None:
    """Send fp32 CPU products to oneDNN (where ``pays_here``), or back to torch's own."""
    global _enabled
    _enabled = bool(on) and LINEAR_POINTWISE is not None


def pays_here() -> bool:
    """Whether oneDNN's fp32 products beat torch's here: on x86 CPUs with AVX-512 not made by Intel,
    where torch's BLAS is MKL and runs AVX2 kernels. A rule, not a timing, so that every process of a
    run (and a resumed run) multiplies alike."""
    if not torch.backends.mkl.is_available() or platform.machine() not in ("x86_64", "AMD64"):
        return False
    vendor, flags = _cpu_info()
    return vendor not in (None, "GenuineIntel") and "avx512f" in flags


def _cpu_info() -> tuple[str | None, set[str]]:
    """The x86 vendor string (GenuineIntel, AuthenticAMD, ...) and the first CPU's feature flags, from
    /proc/cpuinfo; (None, empty) elsewhere."""
    vendor, flags = None, set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    vendor = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return vendor, flags


def onednn_applies(*tensors: Tensor) -> bool:
    """Whether a product of these tensors goes to oneDNN: fp32 on a CPU, outside autocast and outside
    ``torch.compile`` (whose inductor picks its own kernels and cannot lower this op), where
    ``use_onednn``."""
    return (all(t.is_cpu and t.dtype == torch.float32 for t in tensors) and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling() and _enabled)


def rounded_rows(n: int, per_power_of_two: int, multiple: int) -> int:
    """n rounded up to one of ``per_power_of_two`` (itself a power of two) sizes between powers of two,
    and to a multiple of ``multiple``: few distinct row counts, so few oneDNN kernels, for at most
    1/per_power_of_two more rows where ``multiple`` is the smaller step."""
    return round_up(n, max(multiple, 1 << max(0, n.bit_length() - per_power_of_two.bit_length())))


def round_up(n: int, multiple: int) -> int:
    """The least multiple of ``multiple`` that is at least n."""
    return -(-n // multiple) * multiple


def padded_rows(n: int) -> int:
    """Training's row counts: 16 sizes per power of two, multiples of ROW_MULTIPLE; at most 6.25 % more
    rows (1.2 % over Multi30k's batches), and a few row counts where training's batches bring dozens."""
    return rounded_rows(n, 16, ROW_MULTIPLE)


def zero_rows_to(x: Tensor, rows: int) -> Tensor:
    """x (n, k) as a row-major tensor with zero rows appended up to ``rows``: a product's extra rows,
    which add nothing to a weight gradient."""
    if x.shape[0] == rows:
        return x.contiguous()
    padded = x.new_empty(rows, x.shape[1])
    padded[:x.shape[0]].copy_(x)
    padded[x.shape[0]:].zero_()
    return padded


class _Linear(torch.autograd.Function):
    """y = x W^T + b with its three gradients on oneDNN: dx = dy W, dW = dy^T x, db = sum(dy); the rows
    of x and dy padded with zeros (``padded_rows``), which add nothing to dW."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, weight)  # not a padded copy: another op may keep x for its backward too
        ctx.has_bias = bias is not None
        return _padded_product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001
        x, weight = ctx.saved_tensors
        x = x.reshape(-1, x.shape[-1])  # (rows, in)
        flat = zero_rows_to(grad.reshape(x.shape[0], grad.shape[-1]), padded_rows(x.shape[0]))  # (padded, out)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(flat, weight.t())[:x.shape[0]].view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            grad_weight = weight_gradient(flat, x).contiguous()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat.sum(dim=0)
        return grad_x, grad_weight, grad_bias


def weight_gradient(grad: Tensor, x: Tensor) -> Tensor:
    """grad (N, out)^T @ x (n, in) -> (out, in) on oneDNN, for n <= N: x's missing rows count as zeros
    (padded rows, ``_Linear``). oneDNN wants its first operand row-major, so the smaller of the two is
    copied transposed: grad^T, or x^T for x^T @ grad, whose (in, out) result comes back as a
    transposed view (adding it to a gradient costs less than copying it first)."""
    x = zero_rows_to(x, grad.shape[0])  # a row-major copy first: transposed into a slice is 2.5x slower
    if grad.shape[1] < x.shape[1]:
        return _onednn(grad.t().contiguous(), x.t())
    return _onednn(x.t().contiguous(), grad.t()).t()


def on_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether ``linear(x, weight)`` multiplies on oneDNN (not too small a product for it)."""
    return onednn_applies(x, weight) and x.numel() * weight.shape[0] >= MIN_PRODUCT


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, on oneDNN where it is faster (module docstring)."""
    if not on_onednn(x, weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    return _padded_product(x, weight, bias)


def _padded_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., in) @ weight^T + bias on oneDNN, x's rows padded with zeros (``padded_rows``)."""
    rows = x.numel() // x.shape[-1]
    padded = zero_rows_to(x.reshape(rows, x.shape[-1]), padded_rows(rows))  # (padded rows, in)
    return _onednn(padded, weight, bias)[:rows].view(*x.shape[:-1], weight.shape[0])

"""Devices: which one a command runs on, its precisions, its attainable matrix-product peak (what MFU
is measured against), timing on it, and the memory figures a training log reports."""

from __future__ import annotations

import functools
import importlib.util
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from tformer_cli.accel import gemm, ops
from tformer_cli.config import check_device_name
from tformer_cli.errors import UsageError


def resolve_device(name: str = "auto", option: str = "--device") -> torch.device:
    """'auto' picks CUDA when available; asking for CUDA without it is a usage error naming ``option``,
    where the name came from (a config's train.device, say)."""
    check_device_name(name, option)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{option} cuda: no CUDA device is available; use --device cpu or auto")
    return torch.device(name)


PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compile_unsupported(device: torch.device) -> str | None:
    """Why torch.compile cannot compile for ``device``, or None. On a GPU inductor writes Triton kernels,
    and Triton needs the triton package (torch's Linux wheels bring it) and a GPU of compute capability
    7.0 or later: a V100, T4 or later, not the P100 or K80 that some clouds still lend."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major < 7:
        return (f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}, and Triton, "
                "torch.compile's GPU compiler, needs 7.0 or later")
    if importlib.util.find_spec("triton") is None:
        return "Triton, torch.compile's GPU compiler, is not installed (pip install triton)"
    return None


def resolve_precision(setting: str, device: torch.device) -> str:
    """What ``train.precision`` trains in, and ``--precision`` decodes in, on ``device``. ``auto``: bf16 on
    a GPU with bf16 matrix units (compute capability 8.0 and later: A100, H100), where it runs the
    products on the tensor cores and fp32 would run them at a tenth of the speed (decoding holds the
    model in bf16 there: Multi30k's test2016 BLEU within 0.2 of fp32's, benchmarks/README.md, "Third
    lease"); fp32 elsewhere, CPUs included (bf16 pays only on CPUs with AVX-512 BF16 or AMX, so there it
    is asked for). Any other setting (int8 for decoding) as it is."""
    if setting != "auto":
        return setting
    return "bf16" if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0) else "fp32"


def fp16_would_be_faster(setting: str, device: torch.device) -> str | None:
    """Why fp16 would run faster than what ``auto`` resolved to on ``device``, or None: a GPU with fp16
    tensor cores but none for bf16 (compute capability 7.x: V100, T4), where ``auto`` stays in fp32, as
    fairseq and the Hugging Face Trainer do without ``--fp16``: fp16 narrows the range (its loss is scaled,
    and activations past 65,504 overflow), so it is the user's choice, not a default."""
    if setting != "auto" or device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major != 7:
        return None
    return (f"auto is fp32 on {torch.cuda.get_device_name(device)}, which has fp16 tensor cores but none "
            f"for bf16 (compute capability {major}.{minor}); in fp16 its matrix products run about 8x faster")


def autocast(device: torch.device, precision: str):
    """Autocast for "bf16" / "fp16" (matrix products in that type, reductions in fp32); none for "fp32"."""
    if precision == "fp32":
        return nullcontext()
    if precision not in ("bf16", "fp16"):
        raise UsageError(f"precision {precision!r}: use fp32, bf16 or fp16")
    return torch.autocast(device.type, dtype=PRECISION_DTYPES[precision])


def slow_precision(device: torch.device, precision: str) -> str | None:
    """Why ``precision`` would run slower than fp32 on ``device`` (a CPU without native kernels), or None."""
    if device.type != "cpu" or precision == "fp32" or ops.native_on_cpu(precision):
        return None
    return f"{precision}: this CPU has no native {precision} matrix products, so it runs slower than fp32"


@functools.cache
def matmul_peak(device: torch.device, precision: str) -> float:
    """FLOP/s of a product of two square matrices in ``precision`` on ``device``, by the kernel the
    model's linear layers use (on AMD CPUs with AVX-512 the speed layer's oneDNN, not MKL): the best of 5 after 2
    warm-ups, measured once per process (n = 8,192 on a GPU, about 10 ms; 1,024 on a CPU, about 0.1 s
    on 2 cores). It is what model FLOPs utilization (MFU) is measured against: the device's
    attainable peak, not its data sheet's."""
    n = 8192 if device.type == "cuda" else 1024
    generator = torch.Generator(device).manual_seed(0)  # random values (zeros run faster), the run's RNG untouched
    a, b = (torch.randn(n, n, device=device, dtype=PRECISION_DTYPES[precision], generator=generator) for _ in range(2))
    return 2 * n**3 / best_seconds(lambda: gemm.linear(a, b), device)


def best_seconds(operation: Callable[[], Any], device: torch.device, warmup: int = 2, repeats: int = 5) -> float:
    """The fastest of ``repeats`` timed calls of ``operation`` after ``warmup`` untimed ones, each timed
    to the end of its work on ``device`` (a GPU is synchronised around it)."""
    for _ in range(warmup):
        operation()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        operation()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def resident_mib(peak: bool = False, pid: int | str = "self") -> float | None:
    """A process's resident memory in MiB (VmRSS; this one's by default), or its peak since
    ``reset_peak_memory`` (VmHWM); None where there is no /proc (not Linux) or no such process."""
    field = "VmHWM:" if peak else "VmRSS:"
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) / 1024 for line in f if line.startswith(field)), None)
    except OSError:
        return None


def memory_bytes(device: torch.device) -> int | None:
    """All the memory of ``device``: a GPU's, or for the CPU the machine's RAM (which its processes
    share); None where the OS does not say."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return None


def reset_peak_memory(device: torch.device) -> None:
    """Start afresh the peaks that ``resident_mib(peak=True)`` and, on a GPU, torch's allocator report:
    for a process that measures itself (the benchmark's probes). Not for a training run: the kernel's
    resident peak is also what getrusage, ``time -v`` and schedulers report for the whole process."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0
    except OSError:
        pass
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_mib(device: torch.device) -> dict[str, float]:
    """A training log line's memory figures: ``rss_mib``, this process's resident memory now (Linux),
    and on a GPU ``gpu_peak_mib``, the most its tensors held since the last call (the first: since the
    process began; torch's allocator statistic, read without waiting for the device, then reset;
    neither its cache nor CUDA's own)."""
    figures = {"rss_mib": resident_mib()}
    if device.type == "cuda":
        figures["gpu_peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
    return {key: value for key, value in figures.items() if value is not None}

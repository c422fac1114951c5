"""Where a step's time goes: tformer's paper-scale training step (eager and compiled) and decoding
batches (greedy and beam 4), under torch's profiler.

    python benchmarks/profile_step.py --device cuda                 # base, ~25,000 target tokens a step
    python benchmarks/profile_step.py --device cpu --size small --tokens 2000   # a quick look on a CPU

A greedy batch and a beam-4 batch of the paper-scale decoding workloads are profiled first (on CUDA:
a step at a time, then as CUDA graphs, under autocast; then with the model held in bf16); then
training four ways: eager, eager with the speed layer's GPU loss left out (``--accel-skip loss``), compiled,
and compiled layer by layer (``systems.TformerLayersCompiled``: minutes less compiling). For each
it prints the wall time a step, target tokens/s and MFU (the suite's FLOP count against the matrix
peak measured in the same run), the device's kernel time a step and their ratio (how busy the device
is: well under 1 means it waits for the host), the kernel time by kind (matrix products, attention,
the loss, elementwise and normalisation, the optimizer), and the ten costliest kernels. Training runs
the suite's paper-scale batches (``systems.paper_batches``), under bf16 autocast on CUDA.

Experiments, each an extra training variant: ``--attention efficient,cudnn,math`` runs the eager step with
torch's attention held to each of those kernels (``torch.nn.attention.sdpa_kernel``), and
``--compile-attention math,explicit`` the compiled step so (math: torch's kernel, which computes bf16 in
fp32; explicit: the model's explicit path, bf16 products and an fp32 softmax that inductor fuses), and
``--inductor max_autotune_gemm=true`` compiles once more with those inductor settings (that one times
Triton's matrix-product kernels against cuBLAS's, and a Triton product takes the elementwise work after it
into its kernel; with ``--bf16-stream``, on the bf16 stream: what the two buy together), and
``--loss-chunks 2048,16384`` runs the eager step with the loss's logits formed that many tokens at a time,
``--bf16-stream`` trains eager and compiled with the residual stream in bf16 (each embedding's and layer
norm's output cast to bf16, as Megatron keeps it; autocast leaves it in fp32), and compiled with both
that and each ``--compile-attention`` kernel (what the two buy together). On a GPU each compiled
variant compiles for minutes as one graph: ``--experiments-compile layers`` compiles the experiments
layer by layer instead (to compare with the ``layers`` baseline; ``packed``: one graph over batches
packed into rows, to compare with ``compiled-packed``), and ``--baselines`` picks which of
the standard variants run (eager, unfused, compiled, layers by default; packed and compiled-packed
train with ``train.pack_length`` 128), e.g. ``--baselines eager,layers``. For decoding,
``--direct-capture`` records the CUDA graphs without ``torch.cuda.graph``'s device synchronisation and
emptying of the allocator's device and pinned-host caches before each recording (one per batch).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import systems  # noqa: E402
from run import flops_per_target_token, matmul_peak  # noqa: E402
from tformer_cli.accel import graphs  # noqa: E402
from tformer_cli.model.attention import ScaledDotProductAttention, scaled_dot_product_attention  # noqa: E402

# kernel name -> kind, first match wins (cuBLAS/CUTLASS products, torch's attention kernels, ...)
KINDS = [
    ("attention", r"flash|fmha|attention|efficient_attention|mem_eff|sdpa"),
    ("matmul", r"gemm|cutlass|cublas|nvjet|sm90_xmma|wgmma|addmm|\bb?mm\b|matmul|linear"),
    ("loss", r"softmax|scatter|gather|nll|cross_entropy"),
    ("optimizer", r"adam|foreach|multi_tensor"),
    ("norm", r"layer_norm|layernorm|norm"),
    ("dropout", r"dropout|bernoulli|philox|rand"),
]


def kind(name: str) -> str:
    lowered = name.lower()
    return next((k for k, pattern in KINDS if re.search(pattern, lowered)), "elementwise / other")


def measure(label: str, step, device: torch.device, steps: int, warmup: int, rate=None) -> None:  # noqa: ANN001
    """Warm up, time ``steps`` steps, then profile as many; ``rate(seconds a step)`` describes the speed
    (target tokens/s and MFU for training)."""
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    systems.sync(device)
    warm = time.perf_counter() - start  # compiling included, where there is any
    start = time.perf_counter()
    for _ in range(steps):
        step()
    systems.sync(device)
    wall = (time.perf_counter() - start) / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        systems.sync(device)
    if device.type == "cuda":  # kernels: the events that ran on the device
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        duration = lambda e: e.device_time  # noqa: E731 (microseconds)
    else:  # each operator's own time, its children's left out
        kernels = list(prof.events())
        duration = lambda e: e.self_cpu_time_total  # noqa: E731
    by_kind, by_name = Counter(), Counter()
    for e in kernels:
        by_kind[kind(e.name)] += duration(e)
        by_name[e.name[:90]] += duration(e)
    busy = sum(by_kind.values()) / steps / 1e6
    what = "kernels" if device.type == "cuda" else "operators"
    print(f"\n== {label}: {wall * 1e3:,.1f} ms a step (wall), {busy * 1e3:,.1f} ms of {what} "
          f"({busy / wall:.0%} busy), {len(kernels) / steps:,.0f} {what} a step; {warmup} warm-up steps took {warm:,.1f} s")
    if rate is not None:
        print(f"   {rate(wall)}")
    total = sum(by_kind.values())
    for name, us in by_kind.most_common():
        print(f"   {us / steps / 1e3:8.2f} ms  {us / total:5.1%}  {name}")
    print("   costliest:")
    for name, us in by_name.most_common(15):
        print(f"   {us / steps / 1e3:8.2f} ms  {us / total:5.1%}  {name}")


class Variant(NamedTuple):
    """A way to run the training step."""

    label: str
    system: type  # systems.Tformer (eager) or systems.TformerCompiled
    skip: tuple[str, ...] = ()  # speed-layer pieces left out (the fused loss is a GPU piece)
    attention: SDPBackend | str | None = None  # the one kernel torch's attention is held to, or "explicit"
    inductor: dict | None = None  # inductor settings to compile under
    bf16_stream: bool = False  # the residual stream in bf16
    loss_chunk: int | None = None  # tokens a chunk of the fused loss (tformer_cli.loss), instead of its default


BASELINES = {  # the standard training variants (--baselines)
    "eager": Variant("train, eager", systems.Tformer),
    "unfused": Variant("train, eager, the loss unfused", systems.Tformer, skip=("loss",)),
    "compiled": Variant("train, compiled (train.compile)", systems.TformerCompiled),
    "layers": Variant("train, compiled layer by layer", systems.TformerLayersCompiled),
    "packed": Variant(f"train, eager, packed in rows of {systems.PACK_LENGTH}", systems.TformerPacked),
    "compiled-packed": Variant(f"train, compiled, packed in rows of {systems.PACK_LENGTH}",
                               systems.TformerCompiledPacked),
}
DEFAULT_BASELINES = ["eager", "unfused", "compiled", "layers"]


def baseline_names(text: str) -> list[str]:
    """"eager,compiled" -> those of BASELINES."""
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in BASELINES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {','.join(unknown)}: choose from {', '.join(BASELINES)}")
    return names


def inductor_settings(text: str) -> dict[str, object]:
    """"a=true,b=4" -> {"a": True, "b": 4}: torch._inductor.config settings for a compiled variant."""
    import torch._inductor.config as inductor

    settings = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if not hasattr(inductor, key):
            raise argparse.ArgumentTypeError(f"torch {torch.__version__}'s inductor has no setting {key!r}")
        settings[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    return settings


def bf16_stream(model: torch.nn.Module) -> None:
    """Under bf16 autocast, cast the output of the model's embeddings and layer norms to bf16: the
    residual stream, which autocast keeps in fp32 (embedding lookups and layer norms run in fp32 under
    it), is then bf16. Outside autocast (fp32 validation) the model is as it was."""
    from tformer_cli.model.layers import TokenEmbedding

    def to_bf16(module, args, out):  # noqa: ANN001
        device = out.device.type
        in_bf16 = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16
        return out.to(torch.bfloat16) if in_bf16 else out

    for module in model.modules():
        if isinstance(module, (TokenEmbedding, torch.nn.LayerNorm)):
            module.register_forward_hook(to_bf16)


def record_directly(step):
    """``accel.graphs._record`` as ``CUDAGraph.capture_begin``/``capture_end`` on the side stream: what
    ``torch.cuda.graph`` does, without synchronising the device and emptying the caching allocator's
    device and pinned-host caches first (the blocks the next batch then allocates anew)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # the warm-up CUDA graphs want, as _record runs it
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin()
        try:
            step()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph.replay


class ExplicitAttention(torch.nn.Module):
    """Every attention call through the model's explicit path (``attention_weights``, then the product
    with V) instead of a fused kernel: under bf16 autocast the products run in bf16 and the softmax in
    fp32, and inductor fuses the scale, the mask and the softmax into one kernel, with no tiles of 64 or
    128 positions for ~27-token sentences. (torch's own math kernel, ``--compile-attention math``,
    computes bf16 inputs in fp32 throughout.)"""

    def forward(self, q, k, v, mask=None, dropout_p=0.0, need_weights=False, is_causal=False):  # noqa: ANN001
        out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p, need_weights=True, is_causal=is_causal)
        return out, weights if need_weights else None


def explicit_attention(model: torch.nn.Module) -> None:
    """``ExplicitAttention`` in place of each of ``model``'s attention modules."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, ScaledDotProductAttention):
                setattr(module, name, ExplicitAttention())


def attention_label(attention: SDPBackend | str) -> str:
    return "attention explicit (bf16 products, fp32 softmax)" if attention == "explicit" \
        else f"attention by {attention.name}"


def token_counts(text: str) -> list[int]:
    """"512,2048" -> [512, 2048]: each a whole number of at least 1."""
    return [systems.at_least(1)(n) for n in text.split(",") if n]


def attention_backends(text: str) -> list[SDPBackend | str]:
    """"efficient,cudnn" -> those SDPA backends; "explicit": the model's explicit path (``ExplicitAttention``)."""
    names = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH, "explicit": "explicit"}
    unknown = [name for name in filter(None, text.split(",")) if name not in names]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {','.join(unknown)}: choose from {', '.join(names)}")
    return [names[name] for name in filter(None, text.split(","))]


@contextmanager
def compile_cache_for(backend: SDPBackend | str | None):
    """torch.compile's on-disk caches in a folder of their own while attention is held to ``backend``:
    their keys leave out which attention kernel was chosen (pytorch/pytorch#185449), so a variant
    compiled after another would run the other's kernel, from the cache. The folder sits inside the
    usual one, so that gpu.sh carries it too."""
    if not isinstance(backend, SDPBackend):  # the default kernel, or the explicit path (a graph of its own)
        yield
        return
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    usual = cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(usual, f"sdpa-{backend.name.lower()}")
    try:
        yield
    finally:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = usual


@contextmanager
def loss_chunk(device: torch.device, tokens: int | None):
    """The fused loss forms its logits ``tokens`` at a time on ``device``'s kind (None: its default)."""
    from tformer_cli import loss

    name = "GPU_CHUNK_TOKENS" if device.type == "cuda" else "CHUNK_TOKENS"
    default = getattr(loss, name)
    setattr(loss, name, tokens or default)
    try:
        yield
    finally:
        setattr(loss, name, default)


def profile_decoding(args: argparse.Namespace, size: systems.Size, device: torch.device, autocast) -> None:  # noqa: ANN001
    """A greedy and a beam-4 batch of paper-scale decoding: a step at a time and as CUDA graphs, under
    autocast and (on a GPU) with the model held in bf16. The model is freed on return, before training."""
    systems.HOLD_FOR_DECODING = False  # autocast first; then the model held in bf16
    decoder = systems.Tformer(size, device)
    decodes = []  # (workload, one batch of it decoded)
    workloads = () if args.no_decode else (("greedy", 1), ("beam 4", 4))
    for label, beams in workloads:  # as --scale paper batches them
        sources = systems.paper_sources(size, args.sentences, 8192, beams, device)
        src, new_tokens = sources[len(sources) // 2]  # a batch of middling length

        def decode(src=src, new_tokens=new_tokens, beams=beams):
            with autocast(), torch.no_grad():
                if beams == 1:
                    decoder.greedy(src, new_tokens)
                else:
                    decoder.beam(src, new_tokens, beams)

        decodes.append((f"{label}, {src.shape[0]} sources of {src.shape[1]} tokens, {new_tokens} new tokens", decode))
    for workload, decode in decodes:
        if device.type == "cuda":  # the plain loop first: the speed layer's CUDA graphs left out
            graphs.enable(False)
            measure(f"{workload}, a step at a time (--accel-skip graphs)", decode, device, steps=2, warmup=1)
            graphs.enable(True)
        measure(workload, decode, device, steps=2, warmup=1)
        if device.type == "cuda" and args.direct_capture:
            recorded_by_torch, graphs._record = graphs._record, record_directly
            try:
                measure(f"{workload}, graphs recorded directly (--direct-capture)", decode, device, steps=2, warmup=1)
            finally:
                graphs._record = recorded_by_torch
    if device.type == "cuda":  # held in bf16, as `tformer eval --precision bf16` decodes: no autocast casts
        systems.HOLD_FOR_DECODING = True
        for workload, decode in decodes:
            measure(f"{workload}, the model in bf16", decode, device, steps=2, warmup=1)


def training_variants(args: argparse.Namespace) -> list[Variant]:
    """The training variants that ``args`` ask for, in the order they run: the baselines, then the eager
    experiments, then the compiled ones (compiled as ``--experiments-compile`` says)."""
    variants = [BASELINES[name] for name in args.baselines]
    if args.no_compile:  # the eager baselines only
        variants = [variant for variant in variants if variant.system in (systems.Tformer, systems.TformerPacked)]
    variants += [Variant(f"train, eager, {attention_label(b)}", systems.Tformer, attention=b) for b in args.attention]
    variants += [Variant(f"train, eager, the loss {n:,} tokens a chunk", systems.Tformer, loss_chunk=n)
                 for n in args.loss_chunks]
    if args.bf16_stream:
        variants.append(Variant("train, eager, residual stream in bf16", systems.Tformer, bf16_stream=True))
    if args.no_compile:
        return variants
    compiled, how = {"graph": (systems.TformerCompiled, "compiled"),
                     "layers": (systems.TformerLayersCompiled, "compiled layer by layer"),
                     "packed": (systems.TformerCompiledPacked, f"compiled, packed in rows of {systems.PACK_LENGTH}")
                     }[args.experiments_compile]
    variants += [Variant(f"train, {how}, {attention_label(b)}", compiled, attention=b) for b in args.compile_attention]
    if args.bf16_stream:
        variants.append(Variant(f"train, {how}, residual stream in bf16", compiled, bf16_stream=True))
        variants += [Variant(f"train, {how}, {attention_label(b)}, residual stream in bf16", compiled,
                             attention=b, bf16_stream=True) for b in args.compile_attention]  # both at once
    if args.inductor:  # on the bf16 stream where that is asked for: what they buy together
        settings = ", ".join(f"{key}={value}" for key, value in args.inductor.items())
        stream = ", residual stream in bf16" if args.bf16_stream else ""
        variants.append(Variant(f"train, {how} with {settings}{stream}", compiled, inductor=args.inductor,
                                bf16_stream=args.bf16_stream))
    return variants


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", default="base", choices=sorted(systems.SIZES))
    parser.add_argument("--tokens", type=int, default=25_000, help="target tokens a training step")
    parser.add_argument("--steps", type=int, default=6, help="different batches, each profiled once")
    parser.add_argument("--sentences", type=int, default=3000, help="the decoding test set, batched as --scale paper does")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled training step")
    parser.add_argument("--accel", choices=["auto", "off"], default="auto",
                        help="the speed layer; off: the plain model, as a GPU trains it, on a CPU too")
    parser.add_argument("--no-train", action="store_true", help="profile decoding only")
    parser.add_argument("--no-decode", action="store_true", help="profile training only")
    parser.add_argument("--attention", type=attention_backends, default=[],
                        help="eager variants with attention held to these kernels: flash, efficient, cudnn, math, "
                             "explicit")
    parser.add_argument("--loss-chunks", type=token_counts, default=[],
                        help="eager variants with the loss's logits made this many tokens at a time (default 8,192 "
                             "on a GPU): how the passes over them and the projection's gradient trade")
    parser.add_argument("--compile-attention", type=attention_backends, default=[],
                        help="compiled variants with attention held to these kernels")
    parser.add_argument("--inductor", type=inductor_settings, default={},
                        help="a compiled variant with these inductor settings, e.g. max_autotune_gemm=true "
                             "(on the residual stream in bf16 with --bf16-stream)")
    parser.add_argument("--direct-capture", action="store_true",
                        help="decoding also with its CUDA graphs recorded without emptying the allocator's caches")
    parser.add_argument("--bf16-stream", action="store_true",
                        help="eager and compiled variants with the residual stream in bf16")
    parser.add_argument("--baselines", type=baseline_names, default=DEFAULT_BASELINES,
                        help=f"which of the standard training variants run (of {','.join(BASELINES)}; "
                             f"default {','.join(DEFAULT_BASELINES)})")
    parser.add_argument("--experiments-compile", choices=["graph", "layers", "packed"], default="graph",
                        help="how the compiled experiments compile: one graph, as train.compile, or layer by layer "
                             "(minutes less on a GPU; compare them with the 'layers' baseline), or one graph over "
                             "batches packed into rows (compare them with 'compiled-packed')")
    args = parser.parse_args(argv)
    if args.bf16_stream and args.device != "cuda":
        parser.error("--bf16-stream: training runs under bf16 autocast on CUDA only")
    return args


def main() -> None:
    args = parse_arguments()
    device = torch.device(args.device)
    size = systems.SIZES[args.size]
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else nullcontext
    print(f"{size.name} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}")
    systems.ACCEL, systems.ACCEL_SKIP = args.accel, ()
    systems.PRECISION = "bf16" if device.type == "cuda" else "fp32"
    profile_decoding(args, size, device, autocast)
    if args.no_train:
        return
    batches = systems.paper_batches(size, args.tokens, args.steps, device)
    target = sum(b.target_tokens for b in batches) / len(batches)
    flops = flops_per_target_token(args.size, batches) * target  # a step's
    peak = matmul_peak(device, systems.PRECISION)
    print(f"\ntraining: {len(batches)} batches, {target:,.0f} target tokens each on average; the "
          f"{systems.PRECISION} matrix peak measured here {peak / 1e12:,.1f} TFLOP/s")

    def rate(seconds: float) -> str:
        return f"{target / seconds:,.0f} target tokens/s, MFU {flops / seconds / peak:.3f}"

    for variant in training_variants(args):
        systems.ACCEL_SKIP = variant.skip
        system = variant.system(size, device)
        if variant.bf16_stream:
            bf16_stream(system.model)
        if variant.attention == "explicit":
            explicit_attention(system.model)
        batch = itertools.cycle(batches)
        # a context a step (sdpa_kernel's is used up on exit)
        kernels = (lambda backend=variant.attention: sdpa_kernel(backend)) \
            if isinstance(variant.attention, SDPBackend) else nullcontext
        torch._dynamo.reset()  # each compiled variant compiles afresh, not from the graphs of the one before
        if variant.inductor:
            import torch._inductor.config as inductor

            inductor_patch = inductor.patch(variant.inductor)
        else:
            inductor_patch = nullcontext()

        def train_step(system=system, batch=batch, kernels=kernels, inductor_patch=inductor_patch):
            with autocast(), kernels(), inductor_patch:
                system.train_step(next(batch))

        try:
            with compile_cache_for(variant.attention), loss_chunk(device, variant.loss_chunk):
                measure(variant.label, train_step, device, len(batches), warmup=2 * len(batches), rate=rate)
        except Exception as error:  # noqa: BLE001 (a variant that fails on this torch does not stop the rest)
            print(f"\n== {variant.label}: failed: {type(error).__name__}: {str(error).splitlines()[0]}")
        del system


if __name__ == "__main__":
    main()

"""How much of a paper-scale step's attention is padding. On an H200 (2026-11-26) base's compiled step
spent 7.4 of its 37 ms of kernels in attention over sentences of ~27 tokens: far more than their
FLOPs, since a kernel computes a tile of 64 or 128 queries and keys for each sentence and head, most of
it padding. Before the model learns to pack sentences, this measures what packing would buy.

Base's three kinds of attention, forward and backward, over the suite's paper-scale batches
(``systems.paper_step_lengths``), in bf16 on CUDA:

- ``padded``: as the model runs them: each batch padded to its longest sentence, a key-padding mask
  for the encoder's self-attention and the cross-attention, ``is_causal`` for the decoder's;
- ``explicit``: padded, but the explicit softmax(Q K^T / sqrt(d_k)) V of the model's own
  ``attention_weights`` under autocast and ``torch.compile``: two batched products in bf16 and one
  fused softmax kernel, no tiles of 64 or 128 (``profile_step.py --compile-attention explicit`` trains
  the step so);
- ``packed``: the same sentences end to end in rows of at most ``--row`` tokens, attending within
  their own sentence through a block-diagonal mask (causal inside it for the decoder), the same
  ``scaled_dot_product_attention`` call;
- ``flex``: rows of at most ``--flex-row`` tokens through ``flex_attention`` with a block mask,
  compiled: blocks of 128 that hold no allowed pair are skipped, so its rows can be long;
- ``varlen``: no rows: every sentence's tokens one after another (``torch.nn.attention.varlen``, flash;
  CUDA only).

Each variant's output is checked against ``padded`` at the real positions; one that differs (or does
not run on this device or torch) is left out of the table, and why is printed. Printed: milliseconds a
step for the 18 calls of base's 6 + 6 layers (6 of each kind), the median over the batches' repetitions.

    python benchmarks/attention_packing.py --device cuda
    python benchmarks/attention_packing.py --device cpu --tokens 2000 --variants padded,packed   # a check
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import systems  # noqa: E402

VARIANTS = ("padded", "explicit", "packed", "flex", "varlen")
KINDS = ("encoder self", "decoder self", "cross")
_flex = None  # flex_attention, compiled
_explicit = None  # attend_explicitly, compiled


def rows_of(lengths: list[int], row: int) -> list[list[int]]:
    """Sentence indices laid end to end in rows of at most ``row`` tokens, in order (a sentence longer
    than a row gets one of its own)."""
    rows, used = [[]], 0
    for i, length in enumerate(lengths):
        if rows[-1] and used + length > row:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += length
    return rows


class Batch:
    """One batch's sentences for one kind of attention: query and key lengths, and their layouts."""

    def __init__(self, q_lengths: list[int], k_lengths: list[int], causal: bool, row: int, device: torch.device):
        self.q_lengths, self.k_lengths, self.causal, self.device = q_lengths, k_lengths, causal, device
        self.rows = rows_of([max(q, k) for q, k in zip(q_lengths, k_lengths)], row)
        # each packed position's sentence (-1: padding) and the flat padded position (B * T) it holds
        self.q_doc, self.q_from = self._layout(q_lengths)
        self.k_doc, self.k_from = self._layout(k_lengths)
        # the real positions, sentence after sentence: flat indices into the padded layout, and into the
        # packed one (whose rows hold the sentences in order, so its real positions are already in order)
        self.q_real, self.k_real = self._real(q_lengths), self._real(k_lengths)
        self.q_real_packed = (self.q_doc.flatten() >= 0).nonzero().squeeze(1)

    def _layout(self, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(sum(lengths[i] for i in r) for r in self.rows)
        doc = torch.full((len(self.rows), width), -1, dtype=torch.long)
        source = torch.zeros((len(self.rows), width), dtype=torch.long)
        longest = max(lengths)
        for r, sentences in enumerate(self.rows):
            at = 0
            for i in sentences:
                doc[r, at:at + lengths[i]] = i
                source[r, at:at + lengths[i]] = i * longest + torch.arange(lengths[i])
                at += lengths[i]
        return doc.to(self.device), source.to(self.device)

    def _real(self, lengths: list[int]) -> torch.Tensor:
        longest = max(lengths)
        return torch.cat([i * longest + torch.arange(n) for i, n in enumerate(lengths)]).to(self.device)

    def padded_mask(self) -> torch.Tensor | None:
        """(B, 1, 1, T_k) True at real keys, as the model's; None for the decoder (``is_causal``)."""
        if self.causal:
            return None
        real = torch.arange(max(self.k_lengths)) < torch.tensor(self.k_lengths)[:, None]
        return real[:, None, None].to(self.device)

    def packed_mask(self) -> torch.Tensor:
        """(rows, 1, Q, K): a query attends to its own sentence's keys (causal inside it); a padding query
        to every key, so that no row of the softmax is empty (its output is not used)."""
        allowed = self.q_doc[:, :, None] == self.k_doc[:, None, :]
        if self.causal:
            allowed &= torch.ones(allowed.shape[1:], dtype=torch.bool, device=self.device).tril()
        return (allowed | (self.q_doc < 0)[:, :, None])[:, None]

    @staticmethod
    def pack(x: torch.Tensor, doc: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, d) padded -> (rows, H, W, d) packed, padding positions zero."""
        B, H, T, d = x.shape
        flat = x.transpose(1, 2).reshape(B * T, H, d)
        return (flat[source.flatten()].view(*source.shape, H, d) * (doc >= 0)[..., None, None]).transpose(1, 2)

    @staticmethod
    def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Positions ``index`` of x (B, H, T, d), flattened over (B, T): (N, H, d)."""
        B, H, T, d = x.shape
        return x.transpose(1, 2).reshape(B * T, H, d)[index]


def attend_explicitly(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      causal: bool) -> torch.Tensor:
    """The model's explicit path (``scaled_dot_product_attention`` with its weights, as profile_step's
    ``ExplicitAttention`` runs it) under autocast in q's dtype: products in it, softmax in fp32."""
    from tformer_cli.model.attention import scaled_dot_product_attention

    with torch.autocast(q.device.type, dtype=q.dtype, enabled=q.dtype != torch.float32):
        return scaled_dot_product_attention(q, k, v, mask, need_weights=True, is_causal=causal)[0]


def compiled_per_shape(function):  # noqa: ANN001, ANN201
    """``function`` compiled static for each batch's shapes (inductor's CPU templates failed to build
    for dynamic ones, torch 2.13); the limit keeps every batch compiled, never eager."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(function, dynamic=False)


def layout(name: str, batch: Batch, q, k, v):  # noqa: ANN001
    """``name``'s inputs made from the padded q, k, v (B, H, T, d) (new leaves: the step's activations
    would already be laid out so), its attention (a function of them) and how to read its output's real
    positions, sentence after sentence, as (N, H, d)."""
    def leaves(*tensors):  # noqa: ANN002
        return [t.detach().clone().requires_grad_() for t in tensors]

    if name == "padded":
        mask = batch.padded_mask()
        return (leaves(q, k, v), lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                  is_causal=batch.causal),
                lambda out: Batch.take(out, batch.q_real))
    if name == "explicit":
        global _explicit
        _explicit = _explicit or compiled_per_shape(attend_explicitly)
        mask = batch.padded_mask()
        return (leaves(q, k, v), lambda q, k, v: _explicit(q, k, v, mask, batch.causal),
                lambda out: Batch.take(out, batch.q_real))
    if name in ("packed", "flex"):
        packed = leaves(Batch.pack(q, batch.q_doc, batch.q_from), Batch.pack(k, batch.k_doc, batch.k_from),
                        Batch.pack(v, batch.k_doc, batch.k_from))
        read = lambda out: Batch.take(out, batch.q_real_packed)  # noqa: E731
        if name == "packed":
            mask = batch.packed_mask()
            return packed, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), read
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        q_doc, k_doc, causal = batch.q_doc, batch.k_doc, batch.causal

        def allowed(b, h, q_idx, kv_idx):  # noqa: ANN001
            same = (q_doc[b, q_idx] == k_doc[b, kv_idx]) | (q_doc[b, q_idx] < 0)
            return same & (kv_idx <= q_idx) if causal else same

        block = create_block_mask(allowed, q_doc.shape[0], None, q_doc.shape[1], k_doc.shape[1], device=q.device)
        global _flex
        _flex = _flex or compiled_per_shape(flex_attention)
        return packed, lambda q, k, v: _flex(q, k, v, block_mask=block), read
    if name == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        def offsets(lengths: list[int]) -> torch.Tensor:
            return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=q.device)

        cu_q, cu_k = offsets(batch.q_lengths), offsets(batch.k_lengths)
        if "window_size" in inspect.signature(varlen_attn).parameters:  # torch 2.11 on
            causal = {"window_size": (-1, 0) if batch.causal else (-1, -1)}
        else:
            causal = {"is_causal": batch.causal}
        return (leaves(Batch.take(q, batch.q_real), Batch.take(k, batch.k_real), Batch.take(v, batch.k_real)),
                lambda q, k, v: varlen_attn(q, k, v, cu_q, cu_k, max(batch.q_lengths), max(batch.k_lengths), **causal),
                lambda out: out)
    raise ValueError(name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="base", choices=systems.SIZES)
    parser.add_argument("--tokens", type=int, default=25_000, help="target tokens a step (the paper's)")
    parser.add_argument("--steps", type=int, default=6, help="batches, short to long")
    parser.add_argument("--row", type=int, default=128, help="tokens a packed row (SDPA's mask is dense)")
    parser.add_argument("--flex-row", type=int, default=1024, help="tokens a row of flex_attention's")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    device, size = torch.device(args.device), systems.SIZES[args.size]
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        sys.exit(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    H, d = size.heads, size.d_model // size.heads
    times = {(kind, v): [] for kind in KINDS for v in variants}
    failed: dict[str, str] = {}  # variant -> why it did not run
    generator = torch.Generator().manual_seed(0)
    for src_lengths, tgt_lengths in systems.paper_step_lengths(args.tokens, args.steps):
        for kind in KINDS:
            q_lengths = src_lengths if kind == "encoder self" else tgt_lengths
            k_lengths = tgt_lengths if kind == "decoder self" else src_lengths
            batches = {row: Batch(q_lengths, k_lengths, kind == "decoder self", row, device)
                       for row in {args.row, args.flex_row}}
            B = len(q_lengths)
            q, k, v = (torch.randn(B, H, max(n), d, generator=generator).to(device, dtype)
                       for n in (q_lengths, k_lengths, k_lengths))
            reference = None
            for name in [variant for variant in variants if variant not in failed]:
                try:
                    batch = batches[args.flex_row if name == "flex" else args.row]
                    inputs, attend, read = layout(name, batch, q, k, v)
                    out = attend(*inputs)
                    grad = torch.randn(out.shape, generator=generator).to(device, dtype)
                    attend(*inputs).backward(grad)
                except (RuntimeError, NotImplementedError, ImportError) as exc:  # not on this device or torch
                    failed[name] = str(exc).strip().splitlines()[0][:150]
                    print(f"{name}: {failed[name]}")
                    continue
                if reference is None:
                    reference = read(out).detach().float()
                else:  # the same attention at every real position, or the variant is left out
                    try:
                        torch.testing.assert_close(read(out).detach().float(), reference, rtol=2e-2, atol=2e-2)
                    except AssertionError as exc:
                        failed[name] = f"differs from padded ({kind}): " + str(exc).strip().splitlines()[0]
                        print(f"{name}: {failed[name]}")
                        continue
                for repeat in range(1 + args.repeats):  # one more to warm up
                    systems.sync(device)
                    start = time.perf_counter()
                    attend(*inputs).backward(grad)
                    systems.sync(device)
                    if repeat >= 1:
                        times[kind, name].append(time.perf_counter() - start)
    layers = size.layers
    print(f"{size.name}: {args.steps} paper-scale batches of ~{args.tokens:,} target tokens, rows of {args.row} "
          f"tokens ({args.flex_row} for flex); ms a step for {layers} calls of each kind, forward and backward "
          f"({device.type}, {dtype})")
    ran = [v for v in variants if v not in failed]
    print(f"{'':14}" + "".join(f"{v:>10}" for v in ran))
    for kind in (*KINDS, "all"):
        kinds = KINDS if kind == "all" else (kind,)
        cells = [sum(statistics.median(times[k, v]) for k in kinds) * layers * 1e3 for v in ran]
        print(f"{kind:14}" + "".join(f"{c:10.2f}" for c in cells))


if __name__ == "__main__":
    main()

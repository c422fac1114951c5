"""The systems the benchmark compares, behind one small interface.

Every system is built with the same dimensions and random weights (nothing is downloaded) and
offers: ``train_step(batch)`` (forward, label-smoothed loss, backward, optimizer step),
``greedy(src, new_tokens)`` and ``beam(src, new_tokens, beams)``, each producing exactly
``new_tokens`` tokens (no early stop), or ``None`` where a system has no such operation.
"""

from __future__ import annotations

import argparse
import functools
import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

PAD, BOS, EOS = 0, 1, 2
SMOOTHING = 0.1
ACCEL = "auto"  # tformer's speed layer: auto or off (benchmarks/run.py --accel)
PACK_LENGTH = 128  # the packed tformer systems' train.pack_length: one attention tile of 128 positions
ACCEL_SKIP: tuple[str, ...] = ()  # pieces of it left out (benchmarks/run.py --accel-skip)

# nn.Transformer's inference fast path makes nested tensors of masked sources and warns at every call
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors", category=UserWarning)


@dataclass(frozen=True)
class Size:
    name: str
    d_model: int
    layers: int
    heads: int
    d_ff: int
    vocab: int


SIZES = {
    "small": Size("small", 256, 3, 4, 1024, 8000),
    "base": Size("base", 512, 6, 8, 2048, 37000),
    "big": Size("big", 1024, 6, 16, 4096, 37000),  # the paper's Transformer (big)
    # base's depth at 64 wide, decoding one sentence a batch (run.py): the arithmetic vanishes and what is
    # left is the host's work a step, which a GPU waits on (benchmarks/README.md, "Host-bound decoding")
    "host": Size("host", 64, 6, 8, 128, 1000),
}
COMPILE_PEERS = False  # torch.compile nn.Transformer (benchmarks/run.py --scale paper: peers at their best)
PRECISION = "fp32"  # the suite's precision (benchmarks/run.py --precision): CTranslate2 computes in it too
HOLD_FOR_DECODING = True  # tformer decodes as `tformer eval` does: in bf16 on a GPU, the model held in bf16 (Marian too)


def _decoding_precision(model: nn.Module, device: torch.device, accel: str = "auto"):
    """The context a system decodes in, as `tformer eval --precision` decodes: where ``held_in_bf16``
    (bf16 on a GPU), the model held in bf16 (converted at its first batch) and the suite's autocast
    off; elsewhere the suite's own precision."""
    from tformer_cli.cli_options import held_in_bf16

    if not (HOLD_FOR_DECODING and held_in_bf16(device, PRECISION, accel)):
        return nullcontext()
    if next(model.parameters()).dtype != torch.bfloat16:
        model.to(torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


@dataclass
class TrainBatch:
    src: torch.Tensor  # (B, S)
    tgt_in: torch.Tensor  # (B, T)
    tgt_out: torch.Tensor  # (B, T)
    real: torch.Tensor  # the real target tokens' positions in tgt_out.flatten(), found on the host (``batching.Batch``)

    @property
    def target_tokens(self) -> int:
        return self.real.numel()

    @classmethod
    def of(cls, src: torch.Tensor, tgt: torch.Tensor, device: torch.device) -> "TrainBatch":
        """From host tensors: sources (B, S) and targets (B, T + 1) with <s> first."""
        from tformer_cli.batching import real_positions

        real = real_positions(tgt[:, 1:])
        return cls(src.to(device), tgt[:, :-1].to(device), tgt[:, 1:].to(device), real.to(device))


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's), so that a clock read after it times that work."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_batch(size: Size, batch: int, length: int, device: torch.device, seed: int = 0) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(4, size.vocab, (batch, length), generator=generator)
    tgt = torch.randint(4, size.vocab, (batch, length + 1), generator=generator)
    src[:, -1], tgt[:, 0] = EOS, BOS
    return TrainBatch.of(src, tgt, device)


def paper_batches(size: Size, target_tokens: int, count: int, device: torch.device, seed: int = 0) -> list[TrainBatch]:
    """``count`` training batches as ``tformer train`` makes them from a corpus of the paper's size:
    PAPER_CORPUS sentence pairs with lengths drawn like real data (target mean ~27 tokens, a tail past
    100; the source within ~15 % of its target), sorted and cut into batches of about ``target_tokens``
    padded tokens by tformer's own batching (``batching.token_batches``), ``count`` of them taken at
    evenly spaced points of the length order, short to long, as an epoch meets them. (Cut from a pool of
    only a few steps' pairs, each batch would span more lengths and pad twice as much.)"""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for src_lengths, tgt_lengths in paper_step_lengths(target_tokens, count, seed):
        src_ids = torch.full((len(src_lengths), max(src_lengths)), PAD, dtype=torch.long)
        tgt_ids = torch.full((len(tgt_lengths), max(tgt_lengths) + 1), PAD, dtype=torch.long)
        for row, (S, T) in enumerate(zip(src_lengths, tgt_lengths)):
            src_ids[row, :S] = torch.randint(4, size.vocab, (S,), generator=generator)
            src_ids[row, S - 1] = EOS
            tgt_ids[row, 1:T] = torch.randint(4, size.vocab, (T - 1,), generator=generator)
            tgt_ids[row, 0], tgt_ids[row, T] = BOS, EOS
        batches.append(TrainBatch.of(src_ids, tgt_ids, device))
    return batches


def paper_sources(size: Size, sentences: int, max_tokens: int, beams: int, device: torch.device,
                  seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """``sentences`` sources with real lengths (``paper_lengths``) in length order, as ``tformer eval``
    orders a test set, cut as ``tformer eval --max-tokens`` cuts them (``decoding_batches``: at most
    ``max_tokens`` hypothesis tokens, sentences x ``beams`` x longest source), each batch with the
    tokens to decode for it: its longest source's length (a translation is about as long as its
    source; no system stops early)."""
    from tformer_cli.batching import decoding_batches
    from tformer_cli.decoding import DecodeOptions

    generator = torch.Generator().manual_seed(seed)
    lengths = sorted(paper_lengths(sentences, generator)[0])
    batches = []
    for batch in decoding_batches(lengths, DecodeOptions(beam_size=beams), max_tokens=max_tokens):
        longest = lengths[batch.stop - 1]
        src = torch.full((len(batch), longest), PAD, dtype=torch.long)
        for row, i in enumerate(batch):
            src[row, :lengths[i]] = torch.randint(4, size.vocab, (lengths[i],), generator=generator)
            src[row, lengths[i] - 1] = EOS
        batches.append((src.to(device), longest))
    return batches


PAPER_CORPUS = 4_500_000  # sentence pairs: WMT 2014 English-German, the paper's base corpus


@functools.lru_cache(maxsize=None)
def paper_step_lengths(target_tokens: int, count: int, seed: int = 0) -> tuple[tuple[list[int], list[int]], ...]:
    """The source and target lengths (tokens, EOS included; a target's decoder input is as long) of each
    of ``paper_batches``' steps: the same at every model size, so the corpus is drawn and cut once a process."""
    from tformer_cli.batching import token_batches
    from tformer_cli.config import TrainConfig

    src, tgt = _length_tensors(PAPER_CORPUS, torch.Generator().manual_seed(seed))
    ordered = token_batches(src, tgt, target_tokens, shuffle=False, multiple=TrainConfig().batch_multiple)
    picked = [torch.tensor(ordered[(2 * k + 1) * len(ordered) // (2 * count)]) for k in range(count)]
    return tuple((src[indices].tolist(), tgt[indices].tolist()) for indices in picked)


def paper_lengths(pairs: int, generator: torch.Generator) -> tuple[list[int], list[int]]:
    """Source and target lengths in tokens, EOS included, of ``pairs`` sentence pairs drawn like WMT's:
    log-normal targets (mean ~27, ~0.3 % past 100), each source within ~15 % of its target."""
    src, tgt = _length_tensors(pairs, generator)
    return src.tolist(), tgt.tolist()


def _length_tensors(pairs: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tgt = torch.exp(3.1 + 0.55 * torch.randn(pairs, generator=generator)).round().clamp(2, 250)
    src = (tgt * torch.exp(0.15 * torch.randn(pairs, generator=generator))).round().clamp(2, 250)
    return src.long() + 1, tgt.long() + 1


def _adam(params, fused: bool):
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0, fused=fused)


class System:
    name = "system"
    library = "torch"  # the package it needs (run.py loads it before a memory probe's baseline)
    in_cpu_suite = True  # run by default (tformer's variants are run only when named, whatever this says)
    supports_beam = False
    supports_train = True
    decodes = True
    model: nn.Module
    optimizer: torch.optim.Optimizer
    vocab: int

    def logits(self, batch: TrainBatch) -> torch.Tensor:
        """(B, T, V) teacher-forced logits; the peers' training step is built on it."""
        raise NotImplementedError

    def train_step(self, batch: TrainBatch) -> None:
        """What a user of the peer writes: logits, F.cross_entropy with label smoothing, backward, step."""
        self.model.train()
        loss = F.cross_entropy(self.logits(batch).reshape(-1, self.vocab), batch.tgt_out.reshape(-1),
                               ignore_index=PAD, label_smoothing=SMOOTHING)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def greedy(self, src: torch.Tensor, new_tokens: int) -> torch.Tensor | None:
        return None

    def beam(self, src: torch.Tensor, new_tokens: int, beams: int) -> torch.Tensor | None:
        return None


class Tformer(System):
    """tformer itself: fused output projection + loss, fused Adam, KV-cached decoding."""

    library = "tformer_cli"
    supports_beam = True
    int8 = False
    compiled = False  # trains as train.compile does: without the speed layer's modules (accel.MODULE_PIECES)

    def __init__(self, size: Size, device: torch.device, fused: bool = True) -> None:
        from tformer_cli.accel import accelerate
        from tformer_cli.config import ModelConfig
        from tformer_cli.evaluation import label_smoothed_loss
        from tformer_cli.model import build_model

        self.name = "tformer int8" if self.int8 else "tformer"
        cfg = ModelConfig(d_model=size.d_model, num_heads=size.heads, num_encoder_layers=size.layers,
                          num_decoder_layers=size.layers, d_ff=size.d_ff, dropout=0.1, max_len=256)
        self.model = accelerate(build_model(cfg, size.vocab).to(device), device, ACCEL, ACCEL_SKIP, self.int8,
                                self.compiled)
        self.optimizer = _adam(self.model.parameters(), fused)
        self.loss = label_smoothed_loss

    def train_step(self, batch: TrainBatch) -> None:
        from tformer_cli.batching import Batch

        self._step(Batch(batch.src, batch.tgt_in, batch.tgt_out, [], batch.real), batch.target_tokens)

    def _step(self, ours, target_tokens: int) -> None:
        self.model.train()
        loss, _ = self.loss(self.model, ours, SMOOTHING)
        (loss / target_tokens).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _decode(self, src: torch.Tensor, new_tokens: int, beams: int) -> list:
        from tformer_cli.decoding import DecodeOptions, decode_batch

        self.model.eval()
        options = DecodeOptions(beam_size=beams, max_len_a=0, max_len_b=new_tokens, min_len=new_tokens)
        with _decoding_precision(self.model, src.device, ACCEL):
            return decode_batch(self.model, src, options)

    def greedy(self, src, new_tokens):
        return self._decode(src, new_tokens, 1)

    def beam(self, src, new_tokens, beams):
        return self._decode(src, new_tokens, beams)


class TformerCompiled(Tformer):
    """tformer training with ``train.compile: true``: the loss (encoder, decoder and the fused loss)
    under ``torch.compile``, as `tformer train` compiles it. Its decoding is tformer's, not repeated."""

    decodes = False
    compiled = True

    def __init__(self, size: Size, device: torch.device, fused: bool = True) -> None:
        super().__init__(size, device, fused)
        self.name = "tformer +compile"
        from tformer_cli.evaluation import compiled_loss

        self.loss = compiled_loss()


class TformerLayersCompiled(Tformer):
    """An experiment against ``train.compile``'s one graph, whose compiling takes minutes on a GPU:
    each encoder and decoder layer compiled on its own (regional compilation: one graph for each kind
    of layer, which every layer of that kind replays), the embeddings and the loss eager around them."""

    decodes = False
    compiled = True

    def __init__(self, size: Size, device: torch.device, fused: bool = True) -> None:
        super().__init__(size, device, fused)
        self.name = "tformer +compile layers"
        from tformer_cli.accel import ops

        for layer in (*self.model.encoder.layers, *self.model.decoder.layers):
            layer.compile(dynamic=True)
        self.loss = ops.dynamic_sizes_only(self.loss)  # as compiled_loss: each size a symbol of its own


class Packed:
    """A tformer system that trains with ``train.pack_length`` (``PACK_LENGTH``): each batch's pairs
    end to end in rows (``packing.pack``). Each batch is packed once, on the host, the first time it
    comes (a warm-up step), as `tformer train` packs its batches on the host while the GPU works."""

    def __init__(self, size: Size, device: torch.device, fused: bool = True) -> None:
        super().__init__(size, device, fused)
        self.name += f" +pack {PACK_LENGTH}"
        self.packed = {}  # id of a suite batch -> its packed copy on the device

    def train_step(self, batch: TrainBatch) -> None:
        from tformer_cli.batching import Batch
        from tformer_cli.packing import pack

        packed = self.packed.get(id(batch))
        if packed is None:
            host = Batch(batch.src.cpu(), batch.tgt_in.cpu(), batch.tgt_out.cpu(), [])
            packed = self.packed[id(batch)] = pack(host, PACK_LENGTH).to(batch.src.device)
        self._step(packed, batch.target_tokens)


class TformerPacked(Packed, Tformer):
    """tformer, eager, with its batches packed into rows."""

    decodes = False


class TformerCompiledPacked(Packed, TformerCompiled):
    """``train.compile`` with the batches packed into rows."""


class TformerInt8(Tformer):
    """tformer decoding with int8 weights (``--precision int8``), on a CPU."""

    supports_train = False
    int8 = True


class _BuiltinModel(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        d = size.d_model
        self.embedding = nn.Embedding(size.vocab, d, padding_idx=PAD)
        position = torch.arange(512)[:, None]
        inv_freq = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(512, d)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * inv_freq), torch.cos(position * inv_freq)
        self.register_buffer("pe", pe)
        self.dropout = nn.Dropout(0.1)
        self.transformer = nn.Transformer(d, size.heads, size.layers, size.layers, size.d_ff, 0.1, batch_first=True)
        self.out = nn.Linear(d, size.vocab, bias=False)
        self.out.weight = self.embedding.weight
        self.scale = math.sqrt(d)

    def embed(self, tokens):
        return self.dropout(self.embedding(tokens) * self.scale + self.pe[: tokens.shape[1]])

    def forward(self, src, tgt_in):
        return self.out(self.decode(self.encode(src), src == PAD, tgt_in))

    def encode(self, src):
        return self.transformer.encoder(self.embed(src), src_key_padding_mask=src == PAD)

    def decode(self, memory, src_pad, tgt_in):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1], device=tgt_in.device)
        return self.transformer.decoder(self.embed(tgt_in), memory, tgt_mask=causal, tgt_is_causal=True,
                                        memory_key_padding_mask=src_pad)


class TorchBuiltin(System):
    """(a) What a PyTorch user writes from built-ins: nn.Transformer, tied output, F.cross_entropy."""

    def __init__(self, size: Size, device: torch.device, fused: bool = False) -> None:
        self.name = "torch nn.Transformer" + (" +compile" if COMPILE_PEERS else "") + (" +fused AdamW" if fused else "")
        self.model = _BuiltinModel(size).to(device)
        self.optimizer = _adam(self.model.parameters(), fused)
        self.vocab = size.vocab
        self.forward = self.model
        if COMPILE_PEERS:
            # as train.compile compiles tformer: dynamic shapes from the first batch, each size a symbol of
            # its own (torch.compile's default, a static graph and then a dynamic one, took 1.5x as long to
            # compile: benchmarks/README.md, "The peer compiled once")
            from tformer_cli.accel import ops
            self.forward = ops.dynamic_sizes_only(torch.compile(self.model, dynamic=True))

    def logits(self, batch):
        return self.forward(batch.src, batch.tgt_in)

    @torch.inference_mode()
    def greedy(self, src, new_tokens):
        """No cache: the source is encoded once, the whole prefix runs through the decoder at every step."""
        self.model.eval()
        memory, src_pad = self.model.encode(src), src == PAD
        ys = torch.full((src.shape[0], 1), BOS, dtype=torch.long, device=src.device)
        for _ in range(new_tokens):
            logits = self.model.out(self.model.decode(memory, src_pad, ys)[:, -1])
            logits[:, EOS] = float("-inf")
            ys = torch.cat([ys, logits.argmax(-1, keepdim=True)], dim=1)
        return ys


class Marian(System):
    """(b) Hugging Face transformers' MarianMTModel from a MarianConfig (random weights)."""

    library = "transformers"
    supports_beam = True

    def __init__(self, size: Size, device: torch.device, fused: bool = False) -> None:
        from transformers import MarianConfig, MarianMTModel

        self.name = "HF Marian" + (" +fused AdamW" if fused else "")
        config = MarianConfig(
            vocab_size=size.vocab, d_model=size.d_model, encoder_layers=size.layers, decoder_layers=size.layers,
            encoder_attention_heads=size.heads, decoder_attention_heads=size.heads, encoder_ffn_dim=size.d_ff,
            decoder_ffn_dim=size.d_ff, max_position_embeddings=512, pad_token_id=PAD, eos_token_id=EOS,
            bos_token_id=BOS, decoder_start_token_id=BOS, forced_eos_token_id=None, dropout=0.1,
            activation_function="relu", scale_embedding=True, share_encoder_decoder_embeddings=True)
        self.model = MarianMTModel(config).to(device)
        self.optimizer = _adam(self.model.parameters(), fused)
        self.vocab = size.vocab

    def logits(self, batch):
        return self.model(input_ids=batch.src, attention_mask=batch.src != PAD, decoder_input_ids=batch.tgt_in).logits

    def _generate(self, src, new_tokens, beams):
        self.model.eval()
        # held in bf16 where tformer's model is (its best honest setting: HF's torch_dtype=torch.bfloat16),
        # also where tformer's speed layer is off
        with torch.inference_mode(), _decoding_precision(self.model, src.device):
            return self.model.generate(input_ids=src, attention_mask=src != PAD, num_beams=beams, do_sample=False,
                                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=True)

    def greedy(self, src, new_tokens):
        return self._generate(src, new_tokens, 1)

    def beam(self, src, new_tokens, beams):
        return self._generate(src, new_tokens, beams)


class XTransformers(System):
    """(c) lucidrains' x-transformers XTransformer (its defaults, tied embeddings).

    No beam search: its ``beam_search`` (2.31) expands the batch by the beam count after the first
    step but not the cross-attention context, so it fails on encoder-decoder models.
    """

    library = "x_transformers"
    flash = False  # its attention as products and a softmax of its own (its default)

    def __init__(self, size: Size, device: torch.device, fused: bool = False) -> None:
        from x_transformers import XTransformer

        self.name = "x-transformers" + (" (flash)" if self.flash else "") + (" +fused AdamW" if fused else "")
        self.model = XTransformer(
            dim=size.d_model, tie_token_emb=True, enc_num_tokens=size.vocab, enc_depth=size.layers,
            enc_heads=size.heads, enc_max_seq_len=512, enc_ff_mult=size.d_ff // size.d_model,
            enc_attn_dropout=0.0, enc_ff_dropout=0.1, enc_layer_dropout=0.0, dec_num_tokens=size.vocab,
            dec_depth=size.layers, dec_heads=size.heads, dec_max_seq_len=512, dec_ff_mult=size.d_ff // size.d_model,
            dec_attn_dropout=0.0, dec_ff_dropout=0.1, enc_attn_flash=self.flash,
            dec_attn_flash=self.flash).to(device)
        self.optimizer = _adam(self.model.parameters(), fused)
        self.vocab = size.vocab

    def logits(self, batch):
        mask = batch.src != PAD
        memory = self.model.encoder(batch.src, mask=mask, return_embeddings=True)
        return self.model.decoder.net(batch.tgt_in, context=memory, context_mask=mask)

    @torch.inference_mode()
    def greedy(self, src, new_tokens):
        self.model.eval()
        start = torch.full((src.shape[0], 1), BOS, dtype=torch.long, device=src.device)
        return self.model.generate(src, start, new_tokens, mask=src != PAD, temperature=0.0, cache_kv=True)


class XTransformersFlash(XTransformers):
    """(c) x-transformers with its ``attn_flash`` setting: attention through torch's
    scaled_dot_product_attention (fused kernels on a GPU), the same model otherwise. The GPU suite
    runs both, so that its best setting is the one measured best. On a CPU it trained at small 1.01x
    as fast as the default (2026-11-28), so the CPU suite leaves it out unless asked (--peers)."""

    in_cpu_suite = False
    flash = True


class CTranslate2(System):
    """(d) CTranslate2, decoding only: tformer's random weights converted as `tformer export --to
    ctranslate2` converts them, computing in the suite's precision (or with int8 weights, below) on the
    same threads."""

    library = "ctranslate2"
    supports_beam = True
    supports_train = False
    # its compute type per weights kind and the suite's precision (bf16: what tformer's autocast runs)
    COMPUTE_TYPES = {("float", "fp32"): "float32", ("float", "bf16"): "bfloat16",
                     ("int8", "fp32"): "int8", ("int8", "bf16"): "int8_bfloat16"}
    weights = "float"

    def __init__(self, size: Size, device: torch.device, fused: bool = False) -> None:
        import tempfile

        import ctranslate2

        from tformer_cli.config import ModelConfig
        from tformer_cli.export import ctranslate2_spec
        from tformer_cli.model import build_model

        self.compute_type = self.COMPUTE_TYPES[self.weights, PRECISION]
        if self.compute_type not in ctranslate2.get_supported_compute_types(device.type):  # bf16 on most CPUs
            self.compute_type = self.COMPUTE_TYPES[self.weights, "fp32"]
        self.name = f"CTranslate2 {self.compute_type}" + (" +fused AdamW" if fused else "")
        cfg = ModelConfig(d_model=size.d_model, num_heads=size.heads, num_encoder_layers=size.layers,
                          num_decoder_layers=size.layers, d_ff=size.d_ff, max_len=256)
        tokens = [f"t{i}" for i in range(size.vocab)]
        tokens[:4] = ["<pad>", "<s>", "</s>", "<unk>"]
        spec = ctranslate2_spec(build_model(cfg, size.vocab).eval(), cfg, tokens, tokens)
        spec.validate()
        spec.optimize(quantization=None if self.compute_type == "float32" else self.compute_type)
        self.folder = tempfile.TemporaryDirectory()
        spec.save(self.folder.name)
        self.translator = ctranslate2.Translator(self.folder.name, device=device.type, compute_type=self.compute_type,
                                                 intra_threads=torch.get_num_threads())
        self.tokens = tokens

    def _translate(self, src, new_tokens, beams):
        batch = [[self.tokens[i] for i in row if i not in (PAD, EOS)] for row in src.tolist()]  # it adds EOS
        return self.translator.translate_batch(batch, beam_size=beams, max_decoding_length=new_tokens,
                                               min_decoding_length=new_tokens, max_batch_size=len(batch))

    def greedy(self, src, new_tokens):
        return self._translate(src, new_tokens, 1)

    def beam(self, src, new_tokens, beams):
        return self._translate(src, new_tokens, beams)


class CTranslate2Int8(CTranslate2):
    """(e) CTranslate2 with int8 weights (its int8 CPU kernels)."""

    weights = "int8"


PEERS = {"torch": TorchBuiltin, "marian": Marian, "xtransformers": XTransformers,
         "xtransformers-flash": XTransformersFlash, "ct2": CTranslate2, "ct2-int8": CTranslate2Int8,
         "tformer-int8": TformerInt8, "tformer-compile": TformerCompiled,
         "tformer-compile-layers": TformerLayersCompiled, "tformer-pack": TformerPacked,
         "tformer-compile-pack": TformerCompiledPacked}
DEFAULT_PEERS = [key for key, peer in PEERS.items() if not key.startswith("tformer") and peer.in_cpu_suite]


def at_least(minimum: int):
    """argparse type of the benchmark scripts: a whole number of at least ``minimum``."""
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {minimum}")
        return int(text)
    return parse


def available_peers() -> dict[str, type]:
    """Peers whose packages are installed (pip install -e '.[bench]')."""
    import importlib.util

    return {k: v for k, v in PEERS.items() if importlib.util.find_spec(v.library) is not None}

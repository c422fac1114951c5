"""The speed layer's kernels built before training's first step (CPU only): the matrix products that
training would otherwise compile as it meets them, mid-run and inside its clock.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from tformer_cli.accel import build_decoding_kernels, build_kernels
from tformer_cli.devices import autocast
from tformer_cli.encoding import EncodedSplit
from tformer_cli.evaluation import Seq2SeqLoss, label_smoothed_loss, validates_bleu, validation_rows
from tformer_cli.packing import training_batch
from tformer_cli.run_setup import Setup


def build_training_kernels(setup: Setup, data: EncodedSplit, batches: list[list[int]]) -> None:
    """Have the speed layer compile, before the first step, the matrix-product kernels that training
    would otherwise build as it meets them: those of validation's decoding, in its precision, on the
    processes that validate (``linear.build_decoding_kernels``); then those of this epoch's batch shapes
    and of validation, one pass of the objective per shape and one validation (``gemm.build_kernels``
    says why; it does nothing where products are not on oneDNN). The latter not under torch.compile or
    autocast, whose products are not these, nor under FSDP, whose passes would be collectives.
    Nothing is built off the CPU or without the speed layer."""
    cfg = setup.config.train
    if setup.device.type != "cpu":
        return
    if setup.validates_here and validates_bleu(cfg):
        sentences = min(cfg.eval_max_sentences, len(setup.valid_data.pairs))
        sentences = math.ceil(sentences / setup.workers.size) if setup.validates_together else sentences
        with autocast(setup.device, setup.precision):  # validation's precision: its kernels' data type
            build_decoding_kernels(setup.replica if setup.sharded else setup.model,
                                   validation_rows(setup.config.decode, sentences))
    if setup.compiled or setup.precision != "fp32" or setup.sharded:
        return
    src, tgt = data.src.lengths(), data.tgt.lengths()
    shapes: dict[tuple[int, int, int], list[int]] = {}
    for ids in batches:
        rows = torch.tensor(ids)
        shapes.setdefault((len(ids), int(src[rows].max()), int(tgt[rows].max())), ids)
    objective = Seq2SeqLoss(setup.model, cfg.label_smoothing, cfg.rdrop, label_smoothed_loss)
    params = [p for p in setup.model.parameters() if p.requires_grad]

    def one_pass(ids: list[int]) -> None:
        loss, _ = objective(training_batch(data, ids, cfg.pack_length).to(setup.device))
        torch.autograd.grad(loss, params, allow_unused=True)

    passes = [functools.partial(one_pass, ids) for ids in shapes.values()]
    if setup.validates_here:  # validation's loss, and its decoding's encoder: one token decoded
        one_token = replace(setup.config.decode, max_len_a=0.0, max_len_b=1)
        passes.append(functools.partial(setup.validate, setup.model, setup.state.step, one_token))
    build_kernels(passes)

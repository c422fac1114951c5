"""The accelerated model against the plain one: same outputs and gradients, in training and decoding."""

import copy
import itertools
import os
import random

import pytest
import torch
from torch import nn

from conftest import tiny_model_config
from tformer_cli.accel import ONEDNN_CACHE_CAPACITY, accelerate, gemm, linear, widen_kernel_cache
from tformer_cli.accel.attention import CpuAttention
from tformer_cli.accel.dropout import FastDropout
from tformer_cli.accel.linear import FastFeedForward, FastLinear
from tformer_cli.batching import Batch
from tformer_cli.decoding import DecodeOptions, decode_batch
from tformer_cli.evaluation import label_smoothed_loss
from tformer_cli.model import build_model

VOCAB = 40
# a seeded random sample of the architectures the config can describe
ARCHITECTURES = random.Random(7).sample(list(itertools.product(
    ["post", "pre"], ["relu", "gelu"], ["sinusoidal", "learned", "rope", "alibi"], [False, True])), 10)


@pytest.fixture(autouse=True)
def _every_piece_on(monkeypatch):
    """oneDNN products and packed weights even on this CPU and for these tiny layers."""
    monkeypatch.setattr(gemm, "pays_here", lambda: gemm.LINEAR_POINTWISE is not None)
    monkeypatch.setattr(gemm, "MIN_PRODUCT", 0)
    monkeypatch.setattr(linear, "MIN_WEIGHT", 0)
    monkeypatch.setattr(linear, "MIN_WEIGHT_AUTOCAST", 0)
    yield
    gemm.enable(False)


def _pair(**overrides):
    plain = build_model(tiny_model_config(dropout=0.0, **overrides), VOCAB)
    fast = accelerate(copy.deepcopy(plain), "cpu")
    return plain, fast


def _batch():
    src, tgt = torch.randint(4, VOCAB, (3, 9)), torch.randint(4, VOCAB, (3, 8))
    src[1, 6:] = 0
    tgt[2, 5:] = 0
    return Batch(src, tgt[:, :-1], tgt[:, 1:], [0, 1, 2])


@pytest.mark.parametrize("norm,activation,positional,bias", ARCHITECTURES)
def test_the_accelerated_model_trains_and_decodes_like_the_plain_one(norm, activation, positional, bias):
    plain, fast = _pair(norm=norm, activation=activation, positional=positional, attention_bias=bias)
    batch = _batch()
    grads = []
    for model in (plain, fast):
        loss, _ = label_smoothed_loss(model.train(), batch, 0.1)
        loss.backward()
        grads.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-5)
    for name, grad in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    for beam in (1, 3):  # cached decoding: greedy, and beam search
        options = DecodeOptions(beam_size=beam, max_len_a=0, max_len_b=6)
        with torch.no_grad():
            outputs = [decode_batch(model.eval(), batch.src, options) for model in (plain, fast)]
        for ours, theirs in zip(*outputs):
            assert [h.tokens for h in ours] == [h.tokens for h in theirs]
            torch.testing.assert_close(torch.tensor([h.score for h in ours]), torch.tensor([h.score for h in theirs]),
                                       rtol=1e-4, atol=1e-4)


def test_accelerate_swaps_modules_keeping_parameters_ties_and_checkpoint_keys():
    plain, fast = _pair(share_embeddings="all")
    kinds = {type(m) for m in fast.modules()}
    assert {FastLinear, FastFeedForward, CpuAttention} <= kinds and nn.Linear not in kinds
    assert fast.state_dict().keys() == plain.state_dict().keys()
    assert fast.output_proj.weight is fast.decoder.embed.embedding.weight  # still one matrix (§3.4)
    dropped = accelerate(build_model(tiny_model_config(dropout=0.1), VOCAB), "cpu")
    assert any(isinstance(m, FastDropout) for m in dropped.modules())


def test_off_and_other_devices_leave_the_plain_model():
    for device, mode in (("cpu", "off"), ("meta", "auto")):
        model = build_model(tiny_model_config(), VOCAB)
        kinds = {type(m) for m in accelerate(model, device, mode).modules()}
        assert not kinds & {FastLinear, FastFeedForward, CpuAttention, FastDropout}
        assert not gemm._enabled


def test_a_model_on_one_device_leaves_the_other_devices_switches_as_they_were(monkeypatch, compilable_gpu):
    from tformer_cli.accel import fused_loss, graphs

    for module in (gemm, fused_loss, graphs):  # restored after the test
        monkeypatch.setattr(module, "_enabled", module._enabled)
    model = build_model(tiny_model_config(), VOCAB)
    accelerate(model, "cuda", "auto")  # on a CPU machine nothing is moved or swapped for CUDA: switches only
    assert fused_loss._enabled and graphs._enabled
    monkeypatch.setattr(gemm, "pays_here", lambda: True)
    accelerate(build_model(tiny_model_config(), VOCAB), "cpu", "auto")
    assert gemm._enabled and fused_loss._enabled and graphs._enabled
    accelerate(build_model(tiny_model_config(), VOCAB), "cpu", "off")
    assert not gemm._enabled and fused_loss._enabled and graphs._enabled
    accelerate(model, "cuda", "off")
    assert not fused_loss._enabled and not graphs._enabled
    # a GPU that Triton does not compile for (a P100): the fused loss, compiled, is left off; the graphs are not
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 0))
    accelerate(model, "cuda", "auto")
    assert not fused_loss._enabled and graphs._enabled


def test_widen_kernel_cache_sets_capacity_unless_the_user_did(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "")  # recorded, so teardown restores the variable
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    widen_kernel_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE_CAPACITY)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    widen_kernel_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"


def test_int8_weights_decode_like_fp32(trained_run):
    import json

    from typer.testing import CliRunner

    from tformer_cli.cli import app
    from tformer_cli.decoding import translate
    from tformer_cli.runtime import load_run
    from tformer_cli.tokenizer import PAD_ID

    plain, int8 = load_run(trained_run, accel="off"), load_run(trained_run, int8=True)
    linears = [m for m in plain.model.modules() if type(m) is nn.Linear]
    quantized = [m for m in int8.model.modules() if type(m).__module__.startswith("torch.ao.nn.quantized.dynamic")]
    assert len(quantized) == len(linears)  # the output projection too, its fp32 weight kept and still tied
    assert int8.model.output_proj.weight is int8.model.decoder.embed.embedding.weight
    from tformer_cli.batching import pad_sequences

    src = pad_sequences(plain.vocab.encode_sources(["twenty-one thousand", "three hundred four"]))
    tgt = pad_sequences(plain.vocab.encode_targets(["einundzwanzigtausend", "dreihundertvier"]))[:, :-1]
    with torch.no_grad():
        exact, approximate = plain.model(src, tgt), int8.model(src, tgt)
    assert (approximate - exact).abs().max() < 0.05 * exact.abs().max()
    # the next token each model picks after fp32's own greedy outputs, position by position: whole outputs
    # of this 30-step model loop on near-ties, where one flipped choice changes all that follows
    texts = [f"{a} hundred {b}" for a in ("one", "two", "five", "nine") for b in ("seven", "twelve", "forty-one")]
    decoded = translate(plain.model, plain.vocab, texts, DecodeOptions(max_len_a=0, max_len_b=20))
    greedy = [t.outputs[0][0] for t in decoded]
    src = pad_sequences(plain.vocab.encode_sources(texts))
    tgt = pad_sequences(plain.vocab.encode_targets(greedy))
    with torch.no_grad():
        picks = [model(src, tgt[:, :-1]).argmax(dim=-1) for model in (plain.model, int8.model)]
    real = tgt[:, 1:] != PAD_ID
    assert real.sum() > 50 and (picks[0] == picks[1])[real].float().mean() >= 0.9  # 0.97-0.99 measured
    args = ["eval", str(trained_run), "--split", "validation", "--max-samples", "20", "--beam", "1", "--json"]
    fp32 = json.loads(CliRunner().invoke(app, args).stdout)
    result = CliRunner().invoke(app, args + ["--precision", "int8"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["loss"] == pytest.approx(fp32["loss"], rel=0.05)


def test_dynamic_sizes_only_applies_to_its_own_calls_only(monkeypatch):
    from tformer_cli.accel import ops

    seen = []
    wrapped = ops.dynamic_sizes_only(lambda x: seen.append((ops._FX_CONFIG.use_duck_shape,
                                                            torch._dynamo.config.specialize_float)) or x + 1)
    assert wrapped(1) == 2 and seen == [(False, True)]
    # torch's defaults, for every other compilation
    assert ops._FX_CONFIG.use_duck_shape and not torch._dynamo.config.specialize_float
    monkeypatch.setattr(ops, "_FX_CONFIG", None)  # a torch without the setting: the function as it is
    with pytest.warns(UserWarning, match="has no use_duck_shape: torch.compile may compile the model twice"):
        assert ops.dynamic_sizes_only(abs) is abs

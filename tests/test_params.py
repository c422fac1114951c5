import json

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tformer_cli.cli import app
from tformer_cli.config import ModelConfig
from tformer_cli.model import build_model
from tformer_cli.params import parameter_rows, table_bytes, total_params


@settings(max_examples=25, deadline=None)
@given(
    heads=st.integers(1, 4), head_dim=st.sampled_from([2, 4, 6]), enc=st.integers(1, 3), dec=st.integers(1, 3),
    d_ff=st.integers(1, 40), vocab=st.integers(16, 300), tgt_vocab=st.integers(16, 300),
    share=st.sampled_from(["all", "decoder", "none"]), norm=st.sampled_from(["post", "pre"]),
    positional=st.sampled_from(["sinusoidal", "learned", "rope", "alibi"]), bias=st.booleans(),
)
def test_formula_equals_the_built_model(heads, head_dim, enc, dec, d_ff, vocab, tgt_vocab, share, norm, positional,
                                        bias):
    cfg = ModelConfig(d_model=heads * head_dim, num_heads=heads, num_encoder_layers=enc, num_decoder_layers=dec,
                      d_ff=d_ff, share_embeddings=share, norm=norm, positional=positional, max_len=32,
                      attention_bias=bias)
    tgt_vocab = vocab if share == "all" else tgt_vocab
    model = build_model(cfg, vocab, tgt_vocab)
    actual = sum(p.numel() for p in model.parameters())
    assert total_params(cfg, vocab, tgt_vocab) == actual
    rows = parameter_rows(cfg, vocab, tgt_vocab)
    assert all(r.agrees for r in rows)
    assert sum(r.model for r in rows) == actual


@pytest.mark.parametrize("positional", ["sinusoidal", "rope", "learned", "alibi"])
def test_the_positional_tables_bytes_are_what_building_them_takes_at_its_peak(positional):
    """What training checks against the machine's memory before building: the peak of building a model
    with long tables less that of one with short tables, measured by torch's profiler, is what
    table_bytes says the longer tables add (learned positions are parameters, counted apart)."""
    from torch.profiler import ProfilerActivity, profile

    def peak(max_len):
        cfg = ModelConfig(d_model=64, num_heads=4, num_encoder_layers=1, num_decoder_layers=1, d_ff=32,
                          positional=positional, max_len=max_len)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model = build_model(cfg, 16)
        allocations = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                             if e.name() == "[memory]")
        held = top = 0
        for _, change in allocations:
            held += change
            top = max(top, held)
        learned = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "learned" in name)
        return top - learned, table_bytes(cfg)

    (short, short_predicted), (long, long_predicted) = peak(64), peak(4096)
    assert long - short == pytest.approx(long_predicted - short_predicted, rel=0.02)
    assert (long_predicted == 0) == (positional in ("learned", "alibi"))


def test_count_params_base_is_about_63m_and_json_parses():
    result = CliRunner().invoke(app, ["count-params", "--d-model", "512", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    # 37,000 x 512 shared embeddings; 6 encoder layers of 4 d^2 (attention) + 2 d d_ff + d_ff + d (FFN) + 4 d
    # (two LayerNorms); 6 decoder layers of two attentions, the same FFN and three LayerNorms
    layer_ffn = 2 * 512 * 2048 + 2048 + 512
    expected = 37_000 * 512 + 6 * (4 * 512**2 + layer_ffn + 4 * 512) + 6 * (8 * 512**2 + layer_ffn + 6 * 512)
    assert data["totals"]["model"] == data["totals"]["formula"] == expected == 63_045_632
    assert data["paper_layer_params"] == 4 * 512**2 + 2 * 512 * 2048
    assert data["memory_bytes"]["positional_tables"] == 20 * 512 * 512  # sinusoidal, max_len 512: what train counts


def test_count_params_table_and_big_config():
    runner = CliRunner()
    table = runner.invoke(app, ["count-params", "--d-model", "256", "--layers", "3", "--heads", "4"])
    assert table.exit_code == 0 and "encoder FFN" in table.output and "✓" in table.output
    big = json.loads(runner.invoke(app, ["count-params", "configs/big.yaml", "--json"]).output)
    assert 200e6 < big["totals"]["model"] < 220e6


def test_count_params_bad_flags_give_one_line_errors():
    result = CliRunner().invoke(app, ["count-params", "--d-model", "500"])
    assert result.exit_code == 1  # a check of two keys is the mistake of the one given, and says the fix
    assert result.output == ("error: --d-model: d_model 500 is not divisible by num_heads 8 (each head takes "
                             "d_model / num_heads channels); use d_model 496 or 504, or num_heads 10\n")
    # a mistake is named by the flag that made it, once, even where a config file is given too
    for args, line in [(["--layers", "0"], "error: --layers: must be >= 1, got 0"),
                       (["--decoder-layers", "0"], "error: --decoder-layers: must be >= 1, got 0"),
                       (["configs/base.yaml", "--num-heads", "7"], "error: --num-heads: d_model 512 is not divisible"),
                       (["configs/base.yaml", "--set", "model.dropout=2"], "error: --set model.dropout: must be in"),
                       (["--d-model", str(4 * 10 ** 9)], "error: the model is too large for torch to build (Storage "
                                                          "size calculation overflowed"),  # 4 x 10^9 x d_ff floats
                       (["--d-model", str(2 ** 64)], "error: --d-model: expected a 64-bit integer")]:
        result = CliRunner().invoke(app, ["count-params", *args])
        assert result.exit_code == 1 and result.output.startswith(line) and result.output.count("\n") == 1, result.output
    shapes = json.loads(CliRunner().invoke(app, ["count-params", "--layers", "3", "--decoder-layers", "1", "--json"]).output)
    assert (shapes["config"]["num_encoder_layers"], shapes["config"]["num_decoder_layers"]) == (3, 1)


def test_training_flops_per_token_are_the_matrix_products_torch_counts():
    """6 FLOPs a weight a token (forward 2, backward 4) over the matrix products of a training step,
    as torch's FlopCounterMode counts them, attention scores aside (torch counts CPU attention from 2.15 on)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from tformer_cli.params import train_flops_per_token

    cfg = ModelConfig(d_model=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=3, d_ff=48, max_len=64,
                      dropout=0.0, share_embeddings="none")
    model = build_model(cfg, 40, 50)
    B, S, T = 3, 7, 5  # no padding: every token counts
    src, tgt = torch.randint(4, 40, (B, S)), torch.randint(4, 50, (B, T + 1))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(src, tgt[:, :-1]).flatten(0, 1), tgt[:, 1:].flatten()).backward()
    counted = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    products = {op: flops for op, flops in counted.items() if op in ("aten.mm", "aten.addmm")}
    assert all("scaled_dot_product" in op for op in counted.keys() - products.keys()), counted  # nothing else
    assert sum(products.values()) == train_flops_per_token(cfg, 50, S / T) * B * T

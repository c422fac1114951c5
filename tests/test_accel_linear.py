import pytest
import torch
import torch.nn.functional as F

from tformer_cli.accel import linear
from tformer_cli.accel.linear import FastLinear as Linear

needs_packing = pytest.mark.skipif(not linear.PACKING, reason="torch has no oneDNN weight packing here")
needs_bf16_packing = pytest.mark.skipif(not linear.PACKING_BF16, reason="oneDNN has no bf16 products on this CPU")


@pytest.fixture(autouse=True)
def _pack_small_weights(monkeypatch):
    """The layers here are tiny: pack them anyway."""
    monkeypatch.setattr(linear, "MIN_WEIGHT", 0)
    monkeypatch.setattr(linear, "MIN_WEIGHT_AUTOCAST", 0)


@needs_packing
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(64, 32), (4, 3, 32), (1, 32)])
def test_packed_inference_matches_f_linear(shape, bias):
    layer = Linear(32, 48, bias=bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        out = layer(x)
    assert hasattr(layer, "_packed")  # the packed path ran
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert out.shape == (*shape[:-1], 48)


@needs_packing
def test_a_changed_weight_is_packed_again():
    layer = Linear(16, 8)
    x = torch.randn(5, 16)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(-2.0)  # what an optimizer step or load_state_dict does: in place
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(8, 16))  # a new tensor altogether
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_training_uses_f_linear_and_the_state_dict_holds_no_packed_copy():
    layer = Linear(16, 8)
    x = torch.randn(5, 16)
    with torch.no_grad():
        layer(x)
    out = layer(x)
    out.sum().backward()
    torch.testing.assert_close(layer.weight.grad, torch.ones(5, 8).T @ x)
    assert set(layer.state_dict()) == {"weight", "bias"}


def test_other_dtypes_keep_f_linear():
    layer = Linear(16, 8).double()
    x = torch.randn(3, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert not hasattr(layer, "_packed")


@needs_bf16_packing
def test_bf16_autocast_inference_matches_autocast_f_linear():
    layer = Linear(32, 48)
    x = torch.randn(6, 32)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        expected = F.linear(x, layer.weight, layer.bias)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert layer._packed[1] == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def test_bf16_autocast_keeps_f_linear_where_onednn_has_no_bf16_products(monkeypatch):
    monkeypatch.setattr(linear, "PACKING_BF16", False)  # a CPU without AVX-512: torch's packed op would raise
    layer = Linear(32, 48)
    x = torch.randn(6, 32)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        expected = F.linear(x, layer.weight, layer.bias)
    assert not hasattr(layer, "_packed") and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)


@needs_packing
def test_many_rows_and_small_weights_keep_f_linear(monkeypatch):
    layer = Linear(16, 8)
    with torch.no_grad():
        layer(torch.randn(linear.MAX_ROWS + 1, 16))
        assert not hasattr(layer, "_packed")
        monkeypatch.setattr(linear, "MIN_WEIGHT", 16 * 8 + 1)
        layer(torch.randn(4, 16))
        assert not hasattr(layer, "_packed")


@needs_packing
def test_small_weights_are_packed_where_their_products_go_to_onednn_anyway(monkeypatch):
    """Unpacked, oneDNN builds a kernel for every row count that decoding meets; packed, rows are padded."""
    from tformer_cli.accel import gemm

    monkeypatch.setattr(linear, "MIN_WEIGHT", 64 * 64 + 1)
    monkeypatch.setattr(gemm, "MIN_PRODUCT", 0)
    layer = Linear(64, 64)
    x = torch.randn(37, 64)
    with torch.no_grad():
        layer(x)
        assert not hasattr(layer, "_packed")  # torch's products: F.linear
        monkeypatch.setattr(gemm, "_enabled", True)  # products on oneDNN, as on AMD CPUs
        out = layer(x)
    assert hasattr(layer, "_packed")
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_unpacked_inference_applies_the_activation_like_training(activation):
    layer = Linear(16, 8, activation=activation)
    reference = {"relu": F.relu, "gelu": F.gelu}[activation]
    x = torch.randn(linear.MAX_ROWS + 1, 16)  # too many rows to pack: F.linear, then (in place) the activation
    with torch.inference_mode():
        out = layer(x)
    assert not hasattr(layer, "_packed")
    torch.testing.assert_close(out, reference(F.linear(x, layer.weight, layer.bias)))


@needs_bf16_packing
def test_autocast_packs_smaller_weights_than_fp32(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHT", 16 * 8 + 1)
    monkeypatch.setattr(linear, "MIN_WEIGHT_AUTOCAST", 16 * 8)
    layer = Linear(16, 8)
    x = torch.randn(4, 16)
    with torch.no_grad():
        layer(x)
        assert not hasattr(layer, "_packed")  # fp32: below MIN_WEIGHT
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
            expected = F.linear(x, layer.weight, layer.bias)
    assert layer._packed[1] == torch.bfloat16  # bf16: F.linear would cast the weight at every call
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("n, padded", [(1, 8), (8, 8), (61, 64), (130, 144), (500, 512), (1000, 1024)])
def test_rows_are_padded_to_few_sizes_with_little_waste(n, padded):
    assert linear._padded_rows(n) == padded
    assert padded - n < max(8, n / 8)
    assert linear._padded_rows(n, 16) == max(16, padded)  # training's validation (build_decoding_kernels)


@needs_packing
def test_train_mode_drops_the_packed_copy():
    layer = Linear(16, 8)
    with torch.no_grad():
        layer(torch.randn(4, 16))
    assert "_packed" in layer.__dict__
    layer.eval()
    assert "_packed" in layer.__dict__  # kept for the next decoding call
    layer.train()
    assert "_packed" not in layer.__dict__


@needs_packing
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("autocast", [False, pytest.param(True, marks=needs_bf16_packing)])
def test_the_activation_is_fused_into_the_packed_call_and_matches_f_linear(activation, autocast):
    layer = Linear(32, 48, activation=activation)
    reference = {"relu": F.relu, "gelu": F.gelu}[activation]
    for shape in [(8, 1, 32), (5, 32)]:  # as it is, and padded to 8 rows
        x = torch.randn(shape)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = layer(x)
            expected = reference(F.linear(x, layer.weight, layer.bias))
        assert hasattr(layer, "_packed") and out.shape == (*shape[:-1], 48)
        tolerance = 3e-2 if autocast else 1e-5
        torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    x = torch.randn(5, 32, requires_grad=True)  # training: F.linear, then the activation
    torch.testing.assert_close(layer(x), reference(F.linear(x, layer.weight, layer.bias)))


def _product_kernels_compiled(capfd, run) -> list[str]:
    """The matrix-product kernels oneDNN compiles while ``run`` runs (its verbose log, level 'creation')."""
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
        run()
    return [line for line in capfd.readouterr().out.splitlines()
            if "cache_miss" in line and ("inner_product" in line or "matmul" in line)]


@needs_packing
def test_build_decoding_kernels_covers_every_row_count_up_to_the_batch(capfd):
    # shapes no other test multiplies, so that no kernel an earlier test compiled can stand in for one
    layers = torch.nn.Sequential(Linear(37, 211), Linear(211, 37, activation="relu"), Linear(37, 211))
    assert linear.build_decoding_kernels(layers, 40) == 2 * 3  # two layer shapes, rows padded to 16, 32, 48
    assert not any("_packed" in layer.__dict__ for layer in layers)  # the build's packed copies are not kept
    assert all(layer.row_multiple == linear.VALIDATION_ROW_MULTIPLE for layer in layers)  # validation pads alike

    def decode_steps():  # a batch of 40 hypotheses, finishing one by one
        with torch.inference_mode():
            for n in range(40, 0, -1):
                layers(torch.randn(n, 37))

    assert _product_kernels_compiled(capfd, decode_steps) == []

    def new_shape():
        with torch.inference_mode():
            Linear(37, 213)(torch.randn(17, 37))

    assert _product_kernels_compiled(capfd, new_shape) != []  # where there is one, the log shows it


@needs_packing
@pytest.mark.parametrize("build", [False, True])
def test_greedy_decoding_compiles_no_product_kernel_after_build_decoding_kernels(build, capfd, monkeypatch):
    """Training builds them before its first step (train.py), so that its validations compile none
    among the step's buffers."""
    from conftest import tiny_model_config
    from tformer_cli.accel import accelerate, gemm
    from tformer_cli.decoding import DecodeOptions, decode_batch
    from tformer_cli.model import build_model

    monkeypatch.setattr(gemm, "pays_here", lambda: False)  # the encoder's large products stay on torch's BLAS
    # model shapes of this test's own: a kernel compiled by an earlier test cannot stand in for one
    d_model, d_ff, vocab = (40, 72, 53) if build else (24, 88, 47)
    model = accelerate(build_model(tiny_model_config(d_model=d_model, d_ff=d_ff), vocab), "cpu").eval()
    if build:
        assert linear.build_decoding_kernels(model, 40) > 0
    options = DecodeOptions(max_len_a=0, max_len_b=12)
    # 40 and 18 sentences whose encoder products have over MAX_ROWS rows (not packed), as validation's do
    batches = [torch.randint(4, vocab, (rows, -(-(linear.MAX_ROWS + 1) // rows))) for rows in (40, 18)]
    compiled = _product_kernels_compiled(capfd, lambda: [decode_batch(model, src, options) for src in batches])
    assert (compiled == []) == build, compiled[:3]

import pytest
import torch
import torch.nn.functional as F

from tformer_cli.accel import accelerate, gemm
from tformer_cli.config import ModelConfig
from tformer_cli.errors import UsageError
from tformer_cli.loss import linear_smoothed_cross_entropy
from tformer_cli.model import build_model

pytestmark = pytest.mark.skipif(gemm.LINEAR_POINTWISE is None, reason="torch built without oneDNN")


@pytest.fixture
def onednn(monkeypatch):
    """Products on oneDNN whatever this CPU's rule says, however small."""
    monkeypatch.setattr(gemm, "_enabled", True)
    monkeypatch.setattr(gemm, "MIN_PRODUCT", 0)


def _grads(x, weight, bias, product):
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in (x, weight, bias)]
    out = product(*leaves)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("in_features,out_features", [(24, 40), (40, 24)])  # both weight-gradient routes
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 7), (2, 32), (60, 35), (35, 60)])  # rows padded to 64, none, to 2,176
def test_linear_and_its_gradients_equal_f_linear(in_features, out_features, bias, shape, onednn, monkeypatch):
    x = torch.randn(*shape, in_features)
    x = (x.transpose(0, 1).contiguous().transpose(0, 1) if shape[0] > shape[1] else x).requires_grad_()
    weight = torch.randn(out_features, in_features, requires_grad=True)
    b = torch.randn(out_features, requires_grad=True) if bias else None
    assert gemm.onednn_applies(x, weight)
    rows = []  # oneDNN's row counts: of y and dx, and the shared dimension of dW
    onednn_product = gemm._onednn
    monkeypatch.setattr(gemm, "_onednn", lambda x, w, *rest: rows.append((x.shape[0], w.shape[1]))
                        or onednn_product(x, w, *rest))
    ours, our_grads = _grads(x, weight, b, gemm.linear)
    padded = gemm.padded_rows(shape[0] * shape[1])
    assert padded in (64, shape[0] * shape[1], 2176)
    assert rows[:2] == [(padded, in_features), (padded, out_features)] and padded in rows[2]  # y, dx, dW
    theirs, their_grads = _grads(x, weight, b, F.linear)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for mine, reference in zip(our_grads, their_grads):  # sums over up to 2,100 rows, in other orders
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4)
    assert our_grads[1].is_contiguous()


def test_linear_gradient_for_the_input_only_and_the_weight_only(onednn):
    x, weight = torch.randn(5, 8), torch.randn(6, 8)
    for wants in ((True, False), (False, True)):
        ours, our_grads = _grads(x.requires_grad_(wants[0]), weight.requires_grad_(wants[1]), None, gemm.linear)
        theirs, their_grads = _grads(x, weight, None, F.linear)
        for mine, reference in zip(our_grads[:2], their_grads[:2]):
            assert (mine is None) == (reference is None)
            if mine is not None:
                torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)


def test_where_products_go(monkeypatch):
    monkeypatch.setattr(gemm.platform, "machine", lambda: "x86_64")
    for vendor, flags, expected in (("AuthenticAMD", {"avx2", "avx512f"}, True), ("AuthenticAMD", {"avx2"}, False),
                                    ("GenuineIntel", {"avx2", "avx512f"}, False), (None, set(), False)):
        monkeypatch.setattr(gemm, "_cpu_info", lambda: (vendor, flags))
        assert gemm.pays_here() == (expected and torch.backends.mkl.is_available())
    monkeypatch.setattr(gemm, "pays_here", lambda: True)
    model = build_model(ModelConfig(d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1), 20)
    for device, mode, expected in (("cpu", "auto", True), ("cpu", "off", False), ("meta", "auto", False)):
        accelerate(model, device, mode)
        assert gemm._enabled is expected
    with pytest.raises(UsageError, match="--accel fast: use auto"):
        accelerate(model, "cpu", "fast")


def test_not_for_other_dtypes_under_autocast_or_while_compiling(onednn, monkeypatch):
    x, weight = torch.randn(4, 8), torch.randn(3, 8)
    assert gemm.onednn_applies(x, weight)
    assert not gemm.onednn_applies(x.double(), weight.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not gemm.onednn_applies(x, weight)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # inductor cannot lower the op
    assert not gemm.onednn_applies(x, weight)


def test_the_fused_loss_on_onednn_equals_cross_entropy_in_float64(onednn):
    hidden = torch.randn(700, 16, requires_grad=True)  # two chunks of the CPU's 512 tokens
    weight = torch.randn(50, 16, requires_grad=True)
    target = torch.randint(0, 50, (700,))
    loss, _ = linear_smoothed_cross_entropy(hidden, weight, target, 0.1)
    loss.backward()
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    expected = F.cross_entropy(h64 @ w64.T, target, label_smoothing=0.1, reduction="sum")
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


def test_a_training_step_on_onednn_matches_torchs_products(monkeypatch):
    """The whole model's loss and gradients with its products on oneDNN, against torch's own; every
    product oneDNN is asked for has its rows padded (so a few kernels serve every batch shape)."""
    cfg = ModelConfig(d_model=40, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=56, dropout=0.0,
                      max_len=32)  # no width of 64, the padded row count
    model = accelerate(build_model(cfg, 60), "cpu", skip=("dropout", "gemm"))  # the FFN pads its rows once
    src, tgt = torch.randint(4, 60, (3, 9)), torch.randint(4, 60, (3, 7))
    monkeypatch.setattr(gemm, "MIN_PRODUCT", 0)
    calls = []  # (rows of the first operand, the dimension summed over)
    onednn_product = gemm._onednn
    monkeypatch.setattr(gemm, "_onednn", lambda x, w, *rest: calls.append((x.shape[0], w.shape[1]))
                        or onednn_product(x, w, *rest))
    results = []
    for choice in (True, False):
        monkeypatch.setattr(gemm, "_enabled", choice)
        model.zero_grad()
        hidden = model.decode(tgt, model.encode(src)).hidden
        loss, _ = linear_smoothed_cross_entropy(hidden.flatten(0, 1), model.output_proj.weight, tgt.flatten(), 0.1)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    # 27 source and 21 target rows, padded: products of 64 rows, weight gradients summed over 64
    assert calls and all(64 in call for call in calls) and not {21, 27} & {n for call in calls for n in call}


def test_build_kernels_compiles_each_product_once_without_computing_or_drawing(onednn, monkeypatch):
    built = []
    monkeypatch.setattr(gemm, "LINEAR_POINTWISE", lambda x, w, b, *rest: built.append(
        (tuple(x.shape), x.stride(), tuple(w.shape), w.stride(), b is not None)) or F.linear(x, w, b))
    x, weight, bias = torch.randn(5, 8), torch.randn(6, 8, requires_grad=True), torch.randn(6)
    outputs = []

    def one_pass():  # a forward and backward, drawing random numbers as dropout would
        out = gemm.linear(x.requires_grad_(), weight, bias) * torch.rand(6)
        outputs.append(out)
        torch.autograd.grad(out.sum(), [x, weight])

    state = torch.get_rng_state()
    assert gemm.build_kernels([one_pass, one_pass]) == 3  # the forward, the input and the weight gradient
    assert torch.equal(torch.get_rng_state(), state)  # a resumed run draws what it would have
    assert all(torch.equal(out, torch.zeros(5, 6)) for out in outputs)  # the passes' products are not computed
    assert len(built) == len(set(built)) == 3 and sum(b[4] for b in built) == 1  # each compiled once, after
    assert weight.grad is None
    torch.testing.assert_close(gemm.linear(x, weight, bias), F.linear(x, weight, bias))  # then products as before
    gemm.enable(False)
    assert gemm.build_kernels([pytest.fail]) == 0  # products not on oneDNN: nothing to build, no pass run

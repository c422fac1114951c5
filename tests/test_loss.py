import pytest
import torch
import torch.nn.functional as F

import tformer_cli.loss as loss_module
from tformer_cli.accel import fused_loss
from tformer_cli.loss import linear_smoothed_cross_entropy


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("chunk", [4, 1024])
def test_fused_loss_and_gradients_equal_cross_entropy_on_logits(smoothing, chunk, monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_TOKENS", chunk)  # 4: many chunks, a partial last one
    hidden = torch.randn(19, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 50, (19,))
    loss, nll = linear_smoothed_cross_entropy(hidden, weight, target, smoothing)
    (loss * 0.7).backward()
    ours = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    logits = hidden @ weight.T
    expected = F.cross_entropy(logits, target, label_smoothing=smoothing, reduction="sum")
    (expected * 0.7).backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nll.double(), F.cross_entropy(logits, target, reduction="sum"), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[0], hidden.grad, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ours[1], weight.grad, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("rdrop", [0.0, 1.0])
def test_without_gradients_only_the_loss_is_computed(rdrop, monkeypatch):
    # parameters that require gradients, as in validation: no_grad must still skip forming them
    hidden = torch.randn(7, 8, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(20, 8))
    target = torch.randint(0, 20, (7,))

    def fail(*args):
        raise AssertionError("gradients formed under no_grad")

    monkeypatch.setattr(loss_module, "_backpropagate", fail)
    with torch.no_grad():
        if rdrop:
            both, both_nll = linear_smoothed_cross_entropy(torch.cat([hidden, hidden]), weight, target, 0.0, rdrop)
        loss, nll = linear_smoothed_cross_entropy(hidden, weight, target, 0.0)
    if rdrop:  # identical passes: no divergence
        torch.testing.assert_close((both, both_nll), (loss, nll))
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.T, target, reduction="sum"))
    torch.testing.assert_close(nll, loss)


def _rdrop_reference(logits: torch.Tensor, target: torch.Tensor, smoothing: float, alpha: float) -> torch.Tensor:
    """R-Drop as its authors write it: the passes' mean cross-entropy plus alpha times the mean of both KLs."""
    first, second = logits.chunk(2)
    ce = sum(F.cross_entropy(x, target, label_smoothing=smoothing, reduction="sum") for x in (first, second)) / 2
    log_p, log_q = F.log_softmax(first, dim=-1), F.log_softmax(second, dim=-1)
    kl = (F.kl_div(log_p, log_q, log_target=True, reduction="sum")
          + F.kl_div(log_q, log_p, log_target=True, reduction="sum")) / 2
    return ce + alpha * kl


@pytest.mark.parametrize("smoothing, alpha", [(0.0, 1.0), (0.2, 5.0)])
@pytest.mark.parametrize("chunk", [6, 1024])
def test_rdrop_loss_and_gradients_equal_autograd_reference(smoothing, alpha, chunk, monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_TOKENS", chunk)  # 6: 3 rows of each pass a chunk, a partial last one
    hidden = torch.randn(2 * 11, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 50, (11,))
    loss, nll = linear_smoothed_cross_entropy(hidden, weight, target, smoothing, rdrop=alpha)
    (loss * 0.7).backward()
    ours = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    logits = hidden @ weight.T
    expected = _rdrop_reference(logits, target, smoothing, alpha)
    (expected * 0.7).backward()
    torch.testing.assert_close(loss, expected)
    mean_nll = sum(F.cross_entropy(x, target, reduction="sum") for x in logits.detach().chunk(2)) / 2
    torch.testing.assert_close(nll, mean_nll)
    torch.testing.assert_close(ours[0], hidden.grad)
    torch.testing.assert_close(ours[1], weight.grad)


def test_rdrop_of_identical_passes_is_the_plain_loss():
    hidden, weight = torch.randn(9, 8), torch.randn(30, 8)
    target = torch.randint(0, 30, (9,))
    plain = linear_smoothed_cross_entropy(hidden, weight, target, 0.1)
    doubled = linear_smoothed_cross_entropy(torch.cat([hidden, hidden]), weight, target, 0.1, rdrop=3.0)
    torch.testing.assert_close(doubled, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_softmax_is_written_over_the_logits(dtype):
    logits = torch.randn(37, 5003, dtype=dtype) * 4  # rows longer than any vector block, and odd
    expected = F.log_softmax(logits, dim=-1)
    out = loss_module._log_softmax_(logits)
    assert out.data_ptr() == logits.data_ptr()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True])  # the plain path, and the speed layer's GPU terms
def test_under_bf16_autocast_the_loss_and_gradients_stay_near_fp32(fused, request):
    if fused:
        request.getfixturevalue("fused_on_cpu")
    hidden = torch.randn(40, 32, requires_grad=True)
    weight = torch.randn(300, 32, requires_grad=True)
    target = torch.randint(0, 300, (40,))
    expected = F.cross_entropy(hidden @ weight.T, target, label_smoothing=0.1, reduction="sum")
    expected.backward()
    reference = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = linear_smoothed_cross_entropy(hidden, weight, target, 0.1)
    loss.backward()
    assert loss.dtype == torch.float32 and weight.grad.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=2e-2, atol=0)
    for ours, ref in zip((hidden.grad, weight.grad), reference):
        assert (ours - ref).norm() < 0.05 * ref.norm()


def test_on_a_cpu_every_product_has_a_multiple_of_64_rows(monkeypatch):
    # oneDNN keeps a compiled kernel per product shape: a last chunk of any size would add one each batch
    seen, project = [], loss_module._project
    monkeypatch.setattr(loss_module, "_project", lambda h, w, buffer: seen.append(h.shape[0]) or project(h, w, buffer))
    for n in (3, 100, 513, 1100):
        hidden = torch.randn(n, 8, requires_grad=True)
        loss, _ = linear_smoothed_cross_entropy(hidden, torch.randn(20, 8), torch.randint(0, 20, (n,)), 0.1)
        loss.backward()
        assert hidden.grad.shape == (n, 8)
    assert seen and all(rows % loss_module.ROW_MULTIPLE == 0 for rows in seen)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_fused_gpu_terms_equal_cross_entropy_on_logits(smoothing, dtype):
    logits = (torch.randn(23, 301, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, 301, (23,))
    loss, nll, grad = fused_loss.smoothed_terms(logits, target[:, None], smoothing)
    x = logits.double().requires_grad_()
    expected = F.cross_entropy(x, target, label_smoothing=smoothing, reduction="sum")
    expected.backward()
    assert grad.dtype == dtype and loss.dtype == torch.promote_types(dtype, torch.float32)
    exact = dtype != torch.bfloat16  # bf16: only the gradient is rounded, to bf16
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(nll.double(), F.cross_entropy(x.detach(), target, reduction="sum"), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad.double(), x.grad, rtol=1e-6 if exact else 1e-2, atol=1e-7 if exact else 1e-3)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused GPU terms applied on the CPU, uncompiled (the CUDA tests run them compiled)."""
    monkeypatch.setattr(fused_loss, "_enabled", True)
    monkeypatch.setattr(fused_loss, "applies", lambda hidden: fused_loss._enabled)
    monkeypatch.setattr(fused_loss, "_compiled", fused_loss.smoothed_terms)


@pytest.mark.parametrize("chunk", [4, 1024])
def test_the_loss_with_the_fused_terms_equals_the_plain_loss(chunk, monkeypatch, fused_on_cpu):
    monkeypatch.setattr(loss_module, "CHUNK_TOKENS", chunk)
    hidden = torch.randn(19, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 50, (19,))
    used = []
    monkeypatch.setattr(fused_loss, "_compiled", lambda *args: used.append(1) or fused_loss.smoothed_terms(*args))
    loss, nll = linear_smoothed_cross_entropy(hidden, weight, target, 0.1)
    loss.backward()
    assert len(used) == -(-19 // chunk)  # every chunk
    x = (hidden.detach() @ weight.detach().T).requires_grad_()
    expected = F.cross_entropy(x, target, label_smoothing=0.1, reduction="sum")
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(hidden.grad, x.grad @ weight.detach())
    torch.testing.assert_close(weight.grad, x.grad.T @ hidden.detach())


def test_where_the_fused_terms_do_not_compile_the_loss_warns_once_and_stays_right(monkeypatch, fused_on_cpu):
    def no_compiler(*args):
        raise RuntimeError("no C++ compiler\nmore detail")

    monkeypatch.setattr(fused_loss, "_compiled", no_compiler)
    hidden = torch.randn(9, 8, dtype=torch.float64)
    weight = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 20, (9,))
    with pytest.warns(UserWarning, match="did not compile .RuntimeError: no C.. compiler.; the loss runs on the plain"):
        loss, _ = linear_smoothed_cross_entropy(hidden, weight, target, 0.1)
    assert not fused_loss._enabled  # once: the plain path from then on
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.detach().T, target, label_smoothing=0.1,
                                                     reduction="sum"))


def test_accelerate_turns_the_fused_loss_on_for_cuda_models_in_mode_auto(monkeypatch, compilable_gpu):
    from tformer_cli.accel import accelerate

    monkeypatch.setattr(fused_loss, "_enabled", False)
    model = torch.nn.Linear(2, 2)  # nothing to swap; on "cuda" accelerate only sets switches
    for device, mode, skip, on in [("cuda", "auto", (), True), ("cuda", "off", (), False), ("cuda", "auto", (), True),
                                   ("cuda", "auto", ("loss",), False), ("cuda", "auto", (), True),
                                   ("cpu", "auto", ("runtime",), True)]:  # a CPU model leaves CUDA's switch
        accelerate(model, device, mode, skip)
        assert fused_loss._enabled is on, (device, mode, skip)


@pytest.mark.slow  # torch.compile with inductor's C++ backend: ~10 s
def test_the_compiled_fused_terms_equal_the_uncompiled_ones(monkeypatch):
    monkeypatch.setattr(fused_loss, "_compiled", None)
    for n, dtype in [(37, torch.float32), (100, torch.float32), (37, torch.bfloat16)]:  # dynamic rows, two dtypes
        logits, target = (torch.randn(n, 301) * 3).to(dtype), torch.randint(0, 301, (n, 1))
        with pytest.WarningsRecorder() as caught:
            compiled = fused_loss.fused_smoothed_terms(logits, target, 0.1)
        assert compiled is not None and not [w for w in caught if "did not compile" in str(w.message)]
        for ours, plain in zip(compiled, fused_loss.smoothed_terms(logits, target, 0.1)):
            torch.testing.assert_close(ours, plain)


@pytest.mark.slow  # torch.compile: ~20 s
@pytest.mark.parametrize("rdrop", [0.0, 1.0])
def test_train_compiles_the_model_and_leaves_the_fused_loss_to_its_own_kernel(rdrop, monkeypatch, fused_on_cpu):
    from conftest import tiny_model_config
    from tformer_cli.batching import Batch
    from tformer_cli.evaluation import compiled_loss, label_smoothed_loss
    from tformer_cli.model import build_model
    from torch._dynamo.utils import counters

    inside_graph = []  # whether each call of the fused terms was being traced into a compiled graph
    monkeypatch.setattr(fused_loss, "_compiled", lambda *args: inside_graph.append(torch.compiler.is_compiling())
                        or fused_loss.smoothed_terms(*args))
    model = build_model(tiny_model_config(dropout=0.0), 40)
    src, tgt = torch.randint(4, 40, (3, 9)), torch.randint(4, 40, (3, 8))
    src[1, 6:], tgt[2, 5:] = 0, 0
    batch = Batch(src, tgt[:, :-1], tgt[:, 1:], [0, 1, 2])
    results = []
    counters.clear()
    for loss_fn in (label_smoothed_loss, compiled_loss()):
        loss, nll = loss_fn(model, batch, 0.1, rdrop)
        loss.backward()
        results.append((loss.detach(), nll, [p.grad.clone() for p in model.parameters()]))
        model.zero_grad()
    (loss, nll, grads), (eager_loss, eager_nll, eager_grads) = results[1], results[0]
    assert inside_graph == ([] if rdrop else [False, False])  # eager, then after the compiled model: outside it
    assert counters["aot_autograd"]["total"] == 1  # traced once: its floats constants from the start, not on a retry
    torch.testing.assert_close((loss, nll), (eager_loss, eager_nll))
    for ours, eager in zip(grads, eager_grads):
        torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-6)

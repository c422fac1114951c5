import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import copy_attention_into

from tformer_cli.model.attention import (
    KVCache, MultiHeadAttention, causal_mask, padding_mask, scaled_dot_product_attention)

SDPA = F.scaled_dot_product_attention  # torch's, kept before any test patches it


@pytest.mark.parametrize("shape", [(2, 4, 5, 8), (1, 1, 7, 16), (3, 2, 1, 4)])
@pytest.mark.parametrize("masked", ["none", "padding", "causal"])
def test_sdpa_matches_torch_reference_on_both_paths(shape, masked):
    B, H, T, d = shape
    q, k, v = (torch.randn(B, H, T, d) for _ in range(3))
    mask, is_causal = None, False
    if masked == "padding":
        tokens = torch.randint(1, 9, (B, T))
        tokens[0, T // 2 + 1:] = 0
        mask = padding_mask(tokens, 0)
    elif masked == "causal":
        is_causal = True
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    fast, none = scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal)
    explicit, weights = scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, need_weights=True)
    assert none is None
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(explicit, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, T))


def test_additive_mask_equals_boolean_mask():
    q, k, v = (torch.randn(2, 2, 4, 8) for _ in range(3))
    keep = torch.tensor([True, True, False, True])
    additive = torch.zeros(4).masked_fill(~keep, float("-inf"))
    out_bool, w_bool = scaled_dot_product_attention(q, k, v, keep, need_weights=True)
    out_add, w_add = scaled_dot_product_attention(q, k, v, additive, need_weights=True)
    torch.testing.assert_close(out_bool, out_add)
    assert torch.all(w_bool[..., 2] == 0)


def test_causal_weights_are_zero_above_the_diagonal():
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    _, weights = scaled_dot_product_attention(q, k, v, is_causal=True, need_weights=True)
    assert torch.all(weights.triu(diagonal=1) == 0)
    assert torch.equal(causal_mask(3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))


def _copy_into_torch_mha(ours: MultiHeadAttention, d_model: int, num_heads: int) -> nn.MultiheadAttention:
    reference = nn.MultiheadAttention(d_model, num_heads, batch_first=True, bias=ours.out_proj.bias is not None)
    copy_attention_into(ours, reference)
    return reference.eval()


@pytest.mark.parametrize("bias", [False, True])  # the paper's plain projections, and with biases
@pytest.mark.parametrize("need_weights", [False, True])
def test_self_attention_matches_nn_multihead_attention(need_weights, bias):
    d_model, H = 32, 4
    ours = MultiHeadAttention(d_model, H, bias=bias).eval()
    ref = _copy_into_torch_mha(ours, d_model, H)
    x = torch.randn(3, 7, d_model)
    tokens = torch.randint(1, 5, (3, 7))
    tokens[1, 4:] = 0
    out, weights = ours(x, mask=padding_mask(tokens, 0), need_weights=need_weights)
    expected, expected_w = ref(x, x, x, key_padding_mask=tokens == 0, average_attn_weights=False)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(weights, expected_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_cross_attention_matches_nn_multihead_attention(bias):
    d_model, H = 24, 3
    ours = MultiHeadAttention(d_model, H, cross=True, bias=bias).eval()
    assert (ours.q_proj.bias is not None) == (ours.kv_proj.bias is not None) == bias
    ref = _copy_into_torch_mha(ours, d_model, H)
    x, memory = torch.randn(2, 5, d_model), torch.randn(2, 9, d_model)
    out, _ = ours(x, memory=memory)
    expected, _ = ref(x, memory, memory)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_kv_cache_grows_and_returns_all_keys_in_order():
    cache = KVCache(capacity=2)
    keys = [torch.randn(2, 3, 1, 4) for _ in range(5)]
    for key in keys:
        k, v = cache.append(key, key * 2)
    torch.testing.assert_close(k, torch.cat(keys, dim=2))
    torch.testing.assert_close(v, torch.cat(keys, dim=2) * 2)
    assert cache.kv.shape[0] >= 5 and cache.length == 5
    cache.select(torch.tensor([1, 0, 1]))
    expected = torch.cat(keys, dim=2)[[1, 0, 1]]
    assert torch.equal(cache.keys(), expected) and torch.equal(cache.values(), expected * 2)


def test_bf16_autocast_training_on_cpu_keeps_dtype_and_matches_fp32_gradients():
    q, k, v = (torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    expected, _ = scaled_dot_product_attention(q, k, v, mask)
    expected.square().sum().backward()
    reference = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), reference):
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


def test_fp64_training_attention_stays_fp64():
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    out, _ = scaled_dot_product_attention(q, q, q, is_causal=True)
    expected = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected)

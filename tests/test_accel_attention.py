"""The speed layer's attention (accel/attention.py) against torch's kernel and the plain model's."""

import pytest
import torch
import torch.nn.functional as F

from tformer_cli.accel.attention import CpuAttention
from tformer_cli.model.attention import KVCache, padding_mask

SDPA = F.scaled_dot_product_attention  # torch's, kept before any test patches it
attention = CpuAttention()


def scaled_dot_product_attention(*args, **kwargs):
    return attention(*args, **kwargs)


@pytest.mark.parametrize("masked", [False, True])
def test_one_query_at_inference_takes_two_products_and_equals_torchs_kernel(masked, monkeypatch):
    q, k, v = torch.randn(6, 4, 1, 8), torch.randn(6, 4, 9, 8), torch.randn(6, 4, 9, 8)
    tokens = torch.randint(1, 9, (6, 9))
    tokens[1, 5:] = 0
    mask = padding_mask(tokens, 0) if masked else None
    reference = SDPA(q, k, v, attn_mask=mask)
    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or SDPA(*a, **kw))
    with torch.no_grad():
        out, _ = scaled_dot_product_attention(q, k, v, mask)
        strided, _ = scaled_dot_product_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, mask)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(strided, reference, atol=1e-6, rtol=1e-5)
    assert len(calls) == 1  # only the strided keys went to torch's kernel


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_bf16_decoding_on_cpu_caches_bf16_only_with_amx(need_weights, amx, monkeypatch):
    monkeypatch.setattr("tformer_cli.accel.attention.BF16_ATTENTION", amx)
    keys = [torch.randn(2, 3, 1, 8) for _ in range(4)]
    q = torch.randn(2, 3, 1, 8)
    cache = KVCache(dtype_for=attention.cache_dtype)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for key in keys:
            k, v = cache.append(key.bfloat16(), key.bfloat16() * 2)
        out, _ = scaled_dot_product_attention(q.bfloat16(), k, v, need_weights=need_weights)
    assert cache.kv.dtype == (torch.bfloat16 if amx else torch.float32) and out.dtype == torch.bfloat16
    torch.testing.assert_close(k.float(), torch.cat(keys, dim=2).bfloat16().float())
    expected = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(keys, dim=2) * 2)
    torch.testing.assert_close(out.float(), expected, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_inference_attention_on_cpu_runs_the_kernel_in_fp32_without_amx(amx, monkeypatch):
    monkeypatch.setattr("tformer_cli.accel.attention.BF16_ATTENTION", amx)
    seen = []
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, *args, **kwargs: seen.append(q.dtype) or SDPA(q, *args, **kwargs))
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    with torch.inference_mode():
        out, _ = scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
    assert seen == [torch.bfloat16 if amx else torch.float32] and out.dtype == torch.bfloat16
    expected = SDPA(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), is_causal=True)
    torch.testing.assert_close(out.float(), expected, atol=0.02, rtol=0.02)

import pytest
import torch

from tformer_cli.accel.dropout import FastDropout, dropout, keep_mask, random_words


def test_kept_elements_are_scaled_and_the_rate_is_p():
    x = torch.randn(200, 500).abs() + 0.1  # no zeros of its own
    out = dropout(x, 0.3)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.01  # 100,000 draws: the standard error is 0.0015
    # p is rounded to a multiple of 1/65536 (0.3 -> 0.300003), and the scale with it
    torch.testing.assert_close(out[kept], x[kept] / 0.7, rtol=1e-5, atol=0)


def test_mask_lanes_are_uniform_and_the_scale_keeps_the_expected_value():
    torch.manual_seed(0)
    for p in (0.1, 0.2, 0.5):
        keep, scale = keep_mask((1_000_000,), p)
        rate = keep.float().mean().item()
        assert abs(rate - (1 - p)) < 0.002  # the standard error is at most 0.0005
        assert abs(scale * (1 - p) - 1) < 1e-4
    keep, _ = keep_mask((4, 250_000), 0.5)  # each of the four 16-bit lanes of a draw is a fair coin
    lanes = keep.view(-1, 4).float().mean(dim=0)
    assert (lanes - 0.5).abs().max().item() < 0.005


def test_gradient_is_the_mask_over_keep_probability():
    x = torch.randn(64, 32, requires_grad=True)
    out = dropout(x, 0.25)
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(x.grad, (out != 0).float() / 0.75)


def test_backward_keeps_a_one_byte_mask():
    saved = []
    x = torch.randn(8, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        dropout(x, 0.1)
    assert saved and all(t.element_size() == 1 and not t.is_floating_point() for t in saved)


def test_seeded_masks_repeat_and_bf16_inputs_keep_their_dtype():
    x = torch.randn(32, 32)
    torch.manual_seed(5)
    first = dropout(x, 0.5)
    torch.manual_seed(5)
    torch.testing.assert_close(dropout(x, 0.5), first)
    assert dropout(x.bfloat16(), 0.5).dtype == torch.bfloat16


@pytest.mark.parametrize("p", [0.0, 0.4])
def test_identity_in_eval_mode_and_at_zero_rate(p):
    layer = FastDropout(p).eval()
    x = torch.randn(4, 4)
    assert layer(x) is x
    assert dropout(x, 0.0) is x


def test_rate_one_drops_everything():
    assert dropout(torch.ones(3, 3), 1.0).abs().sum().item() == 0


def _splitmix64(state: int, n: int) -> list[int]:
    """The reference generator (Steele, Lea and Flood 2014), in Python integers."""
    mask, out = 2**64 - 1, []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out.append(z - 2**64 if z >= 2**63 else z)  # as int64
    return out


def test_random_words_are_splitmix64_seeded_from_torchs_generator():
    torch.manual_seed(11)
    seed = int(torch.empty((), dtype=torch.int64).random_(-2**63, 2**63 - 1))
    torch.manual_seed(11)
    words = random_words(70_000)  # more than the precomputed Weyl table, which then grows
    reference = _splitmix64(seed % 2**64, 70_000)
    assert words[:1000].tolist() == reference[:1000] and words[-1000:].tolist() == reference[-1000:]
    assert random_words(8).tolist() != words[:8].tolist()  # the next call draws a new seed


def test_masks_are_independent_draws_within_a_call_and_across_calls():
    """The masks are i.i.d. Bernoulli, as torch's are, in what could couple them: the four lanes of one
    word, neighbouring words, and the masks of consecutive calls (consecutive seeds)."""
    torch.manual_seed(3)
    keep = keep_mask((1_000_000,), 0.5)[0]
    patterns = torch.bincount((keep.view(-1, 4).long() * torch.tensor([1, 2, 4, 8])).sum(dim=1), minlength=16)
    expected = 250_000 / 16
    chi2 = ((patterns - expected) ** 2 / expected).sum().item()
    assert chi2 < 37.7  # 15 degrees of freedom: p = 0.001
    for p in (0.1, 0.3):
        first, second = keep_mask((1_000_000,), p)[0].float(), keep_mask((1_000_000,), p)[0].float()
        for a, b in ((first[:-1], first[1:]), (first[:-4], first[4:]), (first, second)):  # lanes, words, calls
            correlation = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
            assert abs(correlation) < 0.005  # 1,000,000 pairs: the standard error is 0.001

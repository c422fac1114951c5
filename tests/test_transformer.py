import pytest
import torch
from torch import nn

from conftest import copy_attention_into, tiny_model_config
from tformer_cli.model import build_model
from tformer_cli.model.transformer import Transformer

VOCAB = 50
POSITIONALS = ["sinusoidal", "learned", "rope", "alibi"]


def _copy_common(ours, ref):
    with torch.no_grad():
        ref.linear1.load_state_dict(ours.ffn.linear1.state_dict())
        ref.linear2.load_state_dict(ours.ffn.linear2.state_dict())
        ref.norm1.load_state_dict(ours.norm1.state_dict())
        ref.norm2.load_state_dict(ours.norm2.state_dict())


def _reference_transformer(model: Transformer, cfg) -> nn.Transformer:
    ref = nn.Transformer(cfg.d_model, cfg.num_heads, cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.d_ff,
                         dropout=0.0, activation=cfg.activation, batch_first=True, norm_first=cfg.norm == "pre")
    # nn.Transformer ends each stack with a LayerNorm; the paper's post-LN stacks do not, pre-LN ones do
    ref.encoder.norm, ref.decoder.norm = model.encoder.final_norm, model.decoder.final_norm
    for ours, theirs in zip(model.encoder.layers, ref.encoder.layers):
        copy_attention_into(ours.self_attn, theirs.self_attn)
        _copy_common(ours, theirs)
    for ours, theirs in zip(model.decoder.layers, ref.decoder.layers):
        copy_attention_into(ours.self_attn, theirs.self_attn)
        copy_attention_into(ours.cross_attn, theirs.multihead_attn)
        _copy_common(ours, theirs)
        theirs.norm3.load_state_dict(ours.norm3.state_dict())
    return ref.eval()


def _batch(B=3, S=9, T=7):
    src = torch.randint(3, VOCAB, (B, S))
    tgt = torch.randint(3, VOCAB, (B, T))
    src[1, 6:] = 0  # padding
    tgt[2, 5:] = 0
    return src, tgt


@pytest.mark.parametrize("norm,activation", [("post", "relu"), ("pre", "gelu")])
@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # the reference's own note about norm_first
def test_full_model_equals_nn_transformer_with_copied_weights(norm, activation):
    cfg = tiny_model_config(share_embeddings="none", norm=norm, activation=activation, attention_bias=True)
    model = build_model(cfg, VOCAB, VOCAB).eval()
    ref = _reference_transformer(model, cfg)
    src, tgt = _batch()
    with torch.no_grad():
        src_x = model.encoder.embed(src)
        tgt_x = model.decoder.embed(tgt)
        T = tgt.shape[1]
        out = ref(src_x, tgt_x, tgt_mask=nn.Transformer.generate_square_subsequent_mask(T),
                  src_key_padding_mask=src == 0, memory_key_padding_mask=src == 0)
        expected = model.output_proj(out)
        logits = model(src, tgt)
    real = tgt != 0
    torch.testing.assert_close(logits[real], expected[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_changing_a_future_target_token_leaves_earlier_outputs_unchanged(positional, norm):
    model = build_model(tiny_model_config(positional=positional, norm=norm), VOCAB).eval()
    src, tgt = _batch()
    changed = tgt.clone()
    changed[:, 4] = (changed[:, 4] + 1) % VOCAB + 3
    with torch.no_grad():
        a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, :4], b[:, :4], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, 4:], b[:, 4:])


@pytest.mark.parametrize("positional", POSITIONALS)
def test_padding_leaves_outputs_at_real_positions_unchanged(positional):
    model = build_model(tiny_model_config(positional=positional), VOCAB).eval()
    src, tgt = torch.randint(3, VOCAB, (2, 6)), torch.randint(3, VOCAB, (2, 5))
    padded_src = torch.cat([src, torch.zeros(2, 4, dtype=torch.long)], dim=1)
    padded_tgt = torch.cat([tgt, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    with torch.no_grad():
        memory = model.encode(src).memory
        padded_memory = model.encode(padded_src).memory
        logits = model(src, tgt)
        padded_logits = model(padded_src, padded_tgt)
    torch.testing.assert_close(padded_memory[:, :6], memory, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded_logits[:, :5], logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("padded", [True, False])
def test_cached_incremental_decoding_equals_full_recomputation(positional, norm, padded):
    model = build_model(tiny_model_config(positional=positional, norm=norm), VOCAB).eval()
    src, tgt = _batch()
    if not padded:
        src[1, 6:] = 5
    with torch.no_grad():
        encoded = model.encode(src)
        full = model.logits(model.decode(tgt, encoded).hidden)
        cache = model.start_cache(encoded, capacity=2)  # small: forces the cache to grow
        assert (cache.memory_mask is None) == (not padded)  # sources without padding need no mask
        steps = [model.logits(model.decode(tgt[:, t:t + 1], encoded, cache).hidden) for t in range(tgt.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_shared_embeddings_are_one_matrix_and_scaled_init():
    model = build_model(tiny_model_config(share_embeddings="all"), VOCAB)
    weight = model.encoder.embed.embedding.weight
    assert weight is model.decoder.embed.embedding.weight is model.output_proj.weight
    assert 0.5 < weight[1:].std().item() * 32 ** 0.5 < 1.5
    untied = build_model(tiny_model_config(share_embeddings="none"), VOCAB)
    assert untied.output_proj.weight is not untied.decoder.embed.embedding.weight


def test_attention_weights_are_returned_on_request():
    model = build_model(tiny_model_config(), VOCAB).eval()
    src, tgt = _batch()
    encoded = model.encode(src, need_weights=True)
    decoded = model.decode(tgt, encoded, need_weights=True)
    assert len(encoded.attention) == 2 and encoded.attention[0].shape == (3, 4, 9, 9)
    assert decoded.self_attention[0].shape == (3, 4, 7, 7)
    assert decoded.cross_attention[1].shape == (3, 4, 7, 9)
    assert torch.all(encoded.attention[0][1, :, :, 6:] == 0)  # padding keys get no weight
    assert torch.all(decoded.self_attention[0].triu(1) == 0)
    assert model.encode(src).attention is None

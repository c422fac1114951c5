import math

import torch

from tformer_cli.model.layers import PositionwiseFeedForward, TokenEmbedding, sinusoidal_table


def test_sinusoidal_table_matches_the_formula():
    d_model, table = 16, sinusoidal_table(50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            assert math.isclose(table[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-6)
            assert math.isclose(table[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-6)


def test_sinusoidal_worked_values():
    # position 1, d_model 4: [sin 1, cos 1, sin 0.01, cos 0.01]
    torch.testing.assert_close(sinusoidal_table(2, 4)[1], torch.tensor([0.8415, 0.5403, 0.0100, 1.0000]),
                               atol=1e-4, rtol=0)


def test_embedding_is_scaled_by_sqrt_d_model_and_adds_positions():
    emb = torch.nn.Embedding(10, 8)
    layer = TokenEmbedding(emb, "sinusoidal", max_len=20, dropout=0.0)
    tokens = torch.tensor([[3, 4, 5]])
    expected = emb(tokens) * math.sqrt(8) + sinusoidal_table(20, 8)[2:5]
    torch.testing.assert_close(layer(tokens, position=2), expected)


def test_word_dropout_zeroes_whole_embeddings_while_training_and_keeps_positions():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 8)
    layer = TokenEmbedding(emb, "sinusoidal", max_len=50, dropout=0.0, word_dropout=0.25)
    tokens = torch.randint(1, 10, (64, 40))
    table = sinusoidal_table(50, 8)[:40]
    words = layer(tokens) - table  # (B, T, d_model): the embeddings alone, each dropped or scaled
    full = emb(tokens) * math.sqrt(8)
    dropped = words.abs().amax(-1) < 1e-6  # (B, T)
    torch.testing.assert_close(words[~dropped], full[~dropped] / 0.75)
    assert abs(dropped.float().mean().item() - 0.25) < 0.03  # 2,560 draws: ~3.5 standard deviations
    layer.eval()
    torch.testing.assert_close(layer(tokens), full + table)


def test_ffn_is_two_linear_maps_around_relu():
    ffn = PositionwiseFeedForward(8, 32)
    x = torch.randn(2, 3, 8)
    expected = torch.relu(x @ ffn.linear1.weight.T + ffn.linear1.bias) @ ffn.linear2.weight.T + ffn.linear2.bias
    torch.testing.assert_close(ffn(x), expected)
    assert ffn.linear1.out_features == 32

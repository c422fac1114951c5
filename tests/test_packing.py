"""Sentence pairs packed into rows (train.pack_length): each pair whole in one row, attention within its
sentence (against F.scaled_dot_product_attention on the sentence alone), and the loss and its gradients
those of the padded batch, in the plain model and through the speed layer."""

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model_config, write_config
from tformer_cli.accel import accelerate
from tformer_cli.batching import collate
from tformer_cli.config import load_config
from tformer_cli.encoding import EncodedSplit
from tformer_cli.evaluation import label_smoothed_loss
from tformer_cli.model import build_model
from tformer_cli.model.attention import scaled_dot_product_attention, segment_mask
from tformer_cli.packing import pack
from tformer_cli.run_folder import step_checkpoints
from tformer_cli.tokenizer import BOS_ID, EOS_ID, PAD_ID
from tformer_cli.train import train


def _split(pairs: int = 11, longest: int = 12, seed: int = 0) -> EncodedSplit:
    """Random sentence pairs of 1 to ``longest`` words: sources end with EOS, targets are <s> ... </s>."""
    g = torch.Generator().manual_seed(seed)

    def words() -> list[int]:
        return torch.randint(4, 40, (int(torch.randint(1, longest + 1, (), generator=g)),), generator=g).tolist()

    src = [words() + [EOS_ID] for _ in range(pairs)]
    tgt = [[BOS_ID] + words() + [EOS_ID] for _ in range(pairs)]
    return EncodedSplit(src, tgt, [("s", "t")] * pairs)


def test_a_packed_batch_holds_each_pair_whole_in_one_row_with_its_own_positions():
    batch = collate(_split(), list(range(11)))
    packed = pack(batch, 28)
    longest = max(int((batch.src != PAD_ID).sum(1).max()), int((batch.tgt_out != PAD_ID).sum(1).max()))
    k = 28 // longest
    assert packed.src.shape[0] < 11 and packed.src.shape[1] <= k * batch.src.shape[1]
    assert packed.num_tokens == batch.num_tokens and packed.indices == batch.indices
    rows = packed.rows
    seen = 0
    for row in range(packed.src.shape[0]):
        for segment in range(1, int(rows.src_segments[row].max()) + 1):
            i = seen  # the pairs are packed in order
            seen += 1
            for ids, segments, positions, padded in (
                    (packed.src, rows.src_segments, rows.src_positions, batch.src),
                    (packed.tgt_in, rows.tgt_segments, rows.tgt_positions, batch.tgt_in),
                    (packed.tgt_out, rows.tgt_segments, rows.tgt_positions, batch.tgt_out)):
                mine = segments[row] == segment
                length = int((batch.src[i] if padded is batch.src else batch.tgt_out[i]).ne(PAD_ID).sum())
                assert mine.sum() == length  # contiguous: one block of columns
                columns = mine.nonzero().squeeze(1)
                assert torch.equal(columns, torch.arange(columns[0], columns[0] + length))
                assert torch.equal(ids[row, columns], padded[i, :length])
                assert torch.equal(positions[row, columns], torch.arange(length))
        assert torch.all((packed.src[row] == PAD_ID) == (rows.src_segments[row] == 0))
    assert seen == 11


def test_a_row_is_never_wider_than_the_batchs_sentences_end_to_end():
    batch = collate(_split(), list(range(11)))
    longest = max(int((batch.src != PAD_ID).sum(1).max()), int((batch.tgt_out != PAD_ID).sum(1).max()))
    exact = pack(batch, 11 * longest)  # room for the 11 sentences in one row
    for length in (12 * longest, 2 ** 62):  # rows were k x longest wide: at 2^62 past what torch can size
        wide = pack(batch, length)
        assert wide.src.shape[0] == 1
        for field in ("src", "tgt_in", "tgt_out"):
            assert torch.equal(getattr(wide, field), getattr(exact, field))
        for field in ("src_segments", "src_positions", "tgt_segments", "tgt_positions"):
            assert torch.equal(getattr(wide.rows, field), getattr(exact.rows, field))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_in_a_packed_row_is_each_sentences_attention_alone(causal):
    """The segment mask against torch's attention over each sentence on its own."""
    g = torch.Generator().manual_seed(1)
    lengths = [5, 3, 7]
    segments = torch.tensor([[1] * 5 + [2] * 3 + [3] * 7 + [0] * 2])  # (1, 17): two columns of padding
    q, k, v = (torch.randn(1, 2, 17, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out, _ = scaled_dot_product_attention(q, k, v, segment_mask(segments, segments), is_causal=causal)
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        alone = F.scaled_dot_product_attention(q[:, :, part], k[:, :, part], v[:, :, part], is_causal=causal)
        torch.testing.assert_close(out[:, :, part], alone)
        start += length
    assert torch.isfinite(out).all()  # the padding queries too


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("rdrop", [0.0, 0.5])
def test_the_packed_loss_and_its_gradients_are_the_padded_batchs(positional, norm, rdrop):
    model = build_model(tiny_model_config(positional=positional, norm=norm), 40).double()
    batch = collate(_split(), list(range(11)))
    results = []
    for layout in (batch, pack(batch, 28)):
        model.zero_grad()
        loss, nll = label_smoothed_loss(model, layout, 0.1, rdrop)
        loss.backward()
        results.append((loss.detach(), nll, [p.grad.clone() for p in model.parameters()]))
    (loss, nll, grads), (packed_loss, packed_nll, packed_grads) = results
    torch.testing.assert_close(packed_loss, loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(packed_nll, nll, rtol=1e-12, atol=1e-12)
    for ours, padded in zip(packed_grads, grads):
        torch.testing.assert_close(ours, padded, rtol=1e-10, atol=1e-12)


def test_through_the_speed_layer_the_packed_loss_is_the_padded_batchs():
    model = accelerate(build_model(tiny_model_config(), 40), torch.device("cpu"), "auto")
    batch = collate(_split(pairs=24, longest=20), list(range(24)))
    losses = [label_smoothed_loss(model, layout, 0.1)[0] for layout in (batch, pack(batch, 64))]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-4)


def test_a_model_with_rope_refuses_packed_rows():
    model = build_model(tiny_model_config(positional="rope"), 40)
    with pytest.raises(ValueError, match="packed rows need model.positional sinusoidal or learned"):
        label_smoothed_loss(model, pack(collate(_split(), list(range(11))), 28), 0.1)


def test_training_on_packed_rows_takes_the_steps_padded_batches_take(tmp_path):
    path = write_config(tmp_path / "p.yaml", model={"dropout": 0.0}, train={"max_steps": 6, "save_every": 6})
    for name, pack_length in (("padded", "null"), ("packed", "64")):
        train(load_config(path, [f"train.pack_length={pack_length}"]), tmp_path / name)
    from safetensors.torch import load_file

    padded, packed = (load_file(str(step_checkpoints(tmp_path / name)[-1] / "model.safetensors"))
                      for name in ("padded", "packed"))
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], rtol=1e-4, atol=1e-5)

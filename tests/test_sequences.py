import pickle
import random

import pytest
import torch

from tformer_cli.sequences import Sequences, TextPairs


def _reference_pad(sequences, indices, pad_id):
    rows = [sequences[i] for i in indices]
    out = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    for r, seq in enumerate(rows):
        out[r, :len(seq)] = torch.tensor(seq)
    return out


def test_flat_sequences_behave_as_the_lists_they_hold():
    rng = random.Random(0)
    lists = [[rng.randrange(40_000) for _ in range(rng.randrange(1, 30))] for _ in range(200)]
    seqs = Sequences.from_lists(lists)
    assert len(seqs) == 200 and seqs.ids.dtype == torch.int32
    assert [seqs[i] for i in range(200)] == lists and list(seqs) == lists
    assert seqs.lengths().tolist() == [len(s) for s in lists]
    parts = Sequences.concat([Sequences.from_lists(lists[:70]), Sequences.from_lists([]),
                              Sequences.from_lists(lists[70:])])
    assert parts == seqs and parts != Sequences.from_lists(lists[:-1])
    assert pickle.loads(pickle.dumps(seqs)) == seqs
    for indices in ([5], [3, 3, 199, 0], rng.sample(range(200), 64)):
        assert torch.equal(seqs.pad(indices, pad_id=0), _reference_pad(lists, indices, 0))
    assert len(Sequences.concat([])) == 0


def test_text_pairs_store_texts_flat_and_read_them_back():
    pairs = [("ein Haus", "a house"), ("", "empty source"), ("Grüße 🙂", "greetings"), ("bad \udcff byte", "x")]
    stored = TextPairs.from_pairs(pairs)
    assert len(stored) == 4 and list(stored) == pairs and stored == pairs
    assert stored[2] == pairs[2] and stored[-1] == pairs[-1] and stored[1:3] == pairs[1:3] and stored[3:9] == pairs[3:]
    assert stored[2:2] == [] and stored.data.numel() == sum(len(t.encode("utf-8", "surrogatepass"))
                                                           for p in pairs for t in p)
    with pytest.raises(IndexError):
        stored[4]
    joined = TextPairs.concat([TextPairs.from_pairs(pairs[:1]), TextPairs.from_pairs([]), TextPairs.from_pairs(pairs[1:])])
    assert joined == stored and len(TextPairs.from_pairs([])) == 0 and list(TextPairs.concat([])) == []

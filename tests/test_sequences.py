import pickle
import random

import torch

from tformer_cli.sequences import Sequences


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
    assert seqs.lengths() == [len(s) for s in lists]
    parts = Sequences.concat([Sequences.from_lists(lists[:70]), Sequences.from_lists([]),
                              Sequences.from_lists(lists[70:])])
    assert parts == seqs and parts != Sequences.from_lists(lists[:-1])
    assert pickle.loads(pickle.dumps(seqs)) == seqs
    for indices in ([5], [3, 3, 199, 0], rng.sample(range(200), 64)):
        assert torch.equal(seqs.pad(indices, pad_id=0), _reference_pad(lists, indices, 0))
    assert len(Sequences.concat([])) == 0

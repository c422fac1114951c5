from tformer_cli.tokenizer import BOS_ID, EOS_ID, PAD_ID, SPECIALS, UNK_ID, Vocabulary

TEXTS = [
    "Drei kleine Füchse laufen über die weiße Brücke in Köln.",
    "A man (in a blue shirt) says: \"Hello, world!\" — doesn't he?",
    "Ein Café à la française coûte 3,50 € – été, naïve, Øresund.",
    "twenty-one thousand four hundred",
] * 5


def test_special_tokens_have_fixed_ids():
    vocab = Vocabulary.train([(t, t) for t in TEXTS], vocab_size=200, min_frequency=1)
    assert [vocab.source.token_to_id(t) for t in SPECIALS] == [PAD_ID, BOS_ID, EOS_ID, UNK_ID]
    src = vocab.encode_sources(["ein Mann"])[0]
    tgt = vocab.encode_targets(["ein Mann"])[0]
    assert src[-1] == EOS_ID and BOS_ID not in src
    assert tgt[0] == BOS_ID and tgt[-1] == EOS_ID and tgt[1:] == src


def test_decoding_round_trips_spaces_punctuation_and_accents():
    vocab = Vocabulary.train([(t, t) for t in TEXTS], vocab_size=300, min_frequency=1)
    ids = vocab.encode_targets(TEXTS[:4])
    assert vocab.decode_targets(ids) == TEXTS[:4]


def test_white_space_is_one_space_between_words_and_none_around_them():
    """Text from the wild has tabs, no-break spaces, doubled and trailing spaces: each run of them is one
    space, so "seven  hundred " is the "seven hundred" the model was trained on (both sides, saved with
    the tokenizer, so exports do the same)."""
    vocab = Vocabulary.train([(t, t) for t in TEXTS], vocab_size=200, min_frequency=1)
    clean = "twenty-one thousand four hundred"
    messy = ["  twenty-one thousand four hundred ", "twenty-one\tthousand  four\u00a0hundred", "twenty-one\u3000"
             "thousand\r\nfour hundred\u2009", "\ufefftwenty-one thousand four hundred"]
    assert vocab.encode_sources(messy) == vocab.encode_sources([clean] * 4)
    assert vocab.encode_targets(messy) == vocab.encode_targets([clean] * 4)


def test_save_and_load_joint_and_separate(tmp_path):
    pairs = [(a, b) for a, b in zip(TEXTS, reversed(TEXTS))]
    joint = Vocabulary.train(pairs, vocab_size=120, min_frequency=1)
    joint.save(tmp_path)
    again = Vocabulary.load(tmp_path)
    assert again.joint and again.encode_sources(TEXTS) == joint.encode_sources(TEXTS)
    separate = Vocabulary.train(pairs, vocab_size=120, min_frequency=1, joint=False)
    folder = tmp_path / "sep"
    folder.mkdir()
    separate.save(folder)
    loaded = Vocabulary.load(folder)
    assert not loaded.joint
    assert loaded.encode_targets(TEXTS) == separate.encode_targets(TEXTS)
    assert loaded.fingerprint() == separate.fingerprint() != joint.fingerprint()


def test_lowercase_option():
    vocab = Vocabulary.train([(t, t) for t in TEXTS], vocab_size=200, min_frequency=1, lowercase=True)
    assert vocab.decode_targets(vocab.encode_targets(["Drei Füchse"])) == ["drei füchse"]


def test_bpe_dropout_segments_afresh_each_time_and_decodes_to_the_same_text():
    vocab = Vocabulary.train([(t, t) for t in TEXTS], vocab_size=300, min_frequency=1)
    plain = vocab.encode_targets(TEXTS[:4])
    noisy = vocab.with_dropout(0.5)
    samples = [noisy.encode_targets(TEXTS[:4]) for _ in range(5)]
    assert noisy.joint and noisy.src_size == vocab.src_size
    assert any(sample != plain for sample in samples) and any(a != b for a, b in zip(samples, samples[1:]))
    for sample in samples:
        assert noisy.decode_targets(sample) == TEXTS[:4]
        assert all(len(s) >= len(p) for s, p in zip(sample, plain))  # skipped merges only split tokens
    assert vocab.encode_targets(TEXTS[:4]) == plain  # the original stays deterministic
    assert vocab.with_dropout(0.0).encode_targets(TEXTS[:4]) == plain

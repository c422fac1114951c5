"""``tformer generate --engine ctranslate2``: tformer's command line over CTranslate2's decoder.

The run's weights are converted in memory, as ``tformer export --to ctranslate2`` converts them
(``--precision int8`` quantizes them, bf16 runs in bfloat16), and loaded once; texts go through the
run's own tokenizer, so inputs and outputs read as they do with tformer's decoder. Greedy outputs
equal tformer's (tests/test_export.py). Where the two differ:

- beam search ranks finished hypotheses by CTranslate2's length penalty, log-probability /
  length ** alpha, where tformer uses GNMT's ((5 + length) / 6) ** alpha;
- the length limit a * source_length + b is taken per batch, from its longest source;
- a prefix is forced as its own tokens (CTranslate2 has no hook to constrain each step), so a prefix
  that ends mid-word is not completed as tformer's ``decoding.Prefix`` completes it (``generate``
  warns of an output that ends where such a prefix ends);
- scores are CTranslate2's: without a forced prefix's log-probabilities, renormalized over the tokens
  it may write (never padding nor the start symbol, and no end of sentence before --min-len), and
  length-normalized in beam search;
- --align, --ensemble, --mbr and --epsilon are tformer's own and are refused.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from tformer_cli.batching import decoding_batches
from tformer_cli.decoding import DecodeOptions, Hypothesis, Translation
from tformer_cli.errors import UsageError
from tformer_cli.runtime import LoadedRun
from tformer_cli.tokenizer import NOT_OUTPUTS, SPECIALS

COMPUTE_TYPES = {"fp32": "float32", "int8": "int8", "bf16": "bfloat16", "fp16": "float16"}  # on a CPU
GPU_COMPUTE_TYPES = {**COMPUTE_TYPES, "int8": "int8_float16"}  # int8 weights, fp16 activations


class CTranslate2Engine:
    """A loaded run's model as a ``ctranslate2.Translator``, translating as ``decoding.translate`` does."""

    def __init__(self, loaded: LoadedRun, device: torch.device, precision: str) -> None:
        from tformer_cli.export import export_ctranslate2

        try:
            import ctranslate2
        except ImportError:
            raise UsageError("--engine ctranslate2: the ctranslate2 package is not installed; pip install "
                             "'tformer[ctranslate2]'") from None
        self.ctranslate2, self.vocab, self.max_len = ctranslate2, loaded.vocab, loaded.config.model.max_len
        self.not_outputs = [[token] for token in SPECIALS[NOT_OUTPUTS]]  # never written, as by tformer's decoding
        types = GPU_COMPUTE_TYPES if device.type == "cuda" else COMPUTE_TYPES
        if precision not in types:
            raise UsageError(f"--precision {precision} with --engine ctranslate2: expected {', '.join(types)}")
        compute_type = types[precision]
        if compute_type not in ctranslate2.get_supported_compute_types(device.type):
            raise UsageError(f"--precision {precision} with --engine ctranslate2: CTranslate2 has no {compute_type} "
                             f"on this {device.type}; use --precision fp32")
        with tempfile.TemporaryDirectory(prefix="tformer-ct2-") as folder:
            out = export_ctranslate2(loaded.model, loaded.config, loaded.vocab, Path(folder) / "model",
                                     None if compute_type == "float32" else compute_type)
            self.translator = ctranslate2.Translator(str(out), device=device.type, compute_type=compute_type,
                                                     intra_threads=torch.get_num_threads() if device.type == "cpu"
                                                     else 0)

    def translate(self, texts: list[str], options: DecodeOptions, batch_size: int | None = None,
                  prefixes: list[str] | None = None, max_tokens: int | None = None) -> list[Translation]:
        """Like ``decoding.translate``: length-sorted batches cut as it cuts them (``decoding_batches``),
        results in input order, empty texts answered without decoding, sources past the model's
        positions truncated and flagged."""
        if options.seed is not None:
            self.ctranslate2.set_random_seed(options.seed)
        ids = self.vocab.encode_sources(texts)
        results = [Translation(text, [("", Hypothesis([], 0.0, 0.0))], len(s) > self.max_len)
                   for text, s in zip(texts, ids)]
        sources = [self.vocab.source_tokens(s[:-1][:self.max_len - 1]) for s in ids]  # CTranslate2 adds EOS
        forced = [self.vocab.target_tokens(p) for p in self.vocab.encode_prefixes(prefixes)] if prefixes else None
        order = sorted((i for i, text in enumerate(texts) if text.strip()), key=lambda i: len(sources[i]))
        lengths = [len(sources[i]) + 1 for i in order]  # ascending, EOS included
        for batch in decoding_batches(lengths, options, batch_size, max_tokens):
            chunk, longest = order[batch.start:batch.stop], lengths[batch.stop - 1]
            prefix = [forced[i] for i in chunk] if forced is not None and any(forced[i] for i in chunk) else None
            room = max(len(p) for p in prefix) + 1 if prefix is not None else 0  # the prefix and a token past it
            # a * source length + b, min_len and the prefix, within the positions: as decoding_rules.max_new_tokens
            limit = min(max(int(options.max_len_a * longest + options.max_len_b), options.min_len, room),
                        self.max_len - 1)
            if prefix is not None:
                prefix = [p[:limit] for p in prefix]
            outputs = self.translator.translate_batch(
                [sources[i] for i in chunk], target_prefix=prefix, max_batch_size=len(chunk), return_scores=True,
                max_decoding_length=limit, min_decoding_length=options.min_len,
                no_repeat_ngram_size=options.no_repeat_ngram, num_hypotheses=options.nbest,
                suppress_sequences=self.not_outputs, **self._search(options))
            for i, output in zip(chunk, outputs):
                tokens = [[self.vocab.target.token_to_id(t) for t in hyp] for hyp in output.hypotheses]
                texts_out = self.vocab.decode_targets(tokens)
                results[i].outputs = [(text, Hypothesis(toks, score, score))
                                      for text, toks, score in zip(texts_out, tokens, output.scores)]
        return results

    @staticmethod
    def _search(options: DecodeOptions) -> dict:
        if options.sample:
            top_p = max(options.top_p, torch.finfo(torch.float32).tiny)  # one that is 0 in its float32 is refused
            return {"beam_size": 1, "sampling_topk": options.top_k, "sampling_topp": top_p,
                    "sampling_temperature": options.temperature, "length_penalty": 0.0}
        return {"beam_size": options.beam_size,  # scores unnormalized where tformer's are (greedy)
                "length_penalty": options.length_penalty if options.beam_size > 1 else 0.0}

"""The detokenizer's direct use of the Rust tokenizer gives transformers' decode text."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from atom.default_model import default_model_path
from atom.engine.detokenizer import Detokenizer, _fast_decode


def test_fast_decode_matches_transformers_decode():
    tok = AutoTokenizer.from_pretrained(default_model_path())
    fast = _fast_decode(tok)
    assert fast is not None  # the bundled tokenizer takes the fast path
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 16))] + rng.sample(special, 1)
        rng.shuffle(ids)
        for skip in (True, False):
            assert fast(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def test_tokenizer_that_cleans_up_spaces_keeps_transformers_decode():
    tok = AutoTokenizer.from_pretrained(default_model_path())
    tok.clean_up_tokenization_spaces = True
    assert _fast_decode(tok) is None
    assert Detokenizer(tok)._decode.__func__ is Detokenizer._slow_decode

"""Incremental text equals a full decode; stop strings cut the text and never leak."""

from __future__ import annotations

import random

from common.tokenizer import Tokenizer
from router.detokenizer import IncrementalDetokenizer


def test_incremental_equals_full_decode(tiny_llama):
    tokenizer = Tokenizer(tiny_llama)
    rng = random.Random(0)
    text = "Grüße, 世界! def f(x): return x ** 2  # ✓ done"
    for _ in range(5):
        ids = tokenizer.encode(text, add_special_tokens=False) + [
            rng.randrange(5, tokenizer.vocab_size) for _ in range(40)
        ]
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.add([t]) for t in ids] + [detok.finish()]
        assert "".join(pieces) == tokenizer.decode(ids)


def test_stop_string_cuts_and_is_never_streamed(tiny_llama):
    tokenizer = Tokenizer(tiny_llama)
    ids = tokenizer.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["gamma", "zzz"])
    streamed = ""
    for token in ids:
        streamed += detok.add([token])
        if detok.stopped:
            break
    streamed += detok.finish()
    assert streamed == "alpha beta "
    assert detok.stop_string == "gamma"
    assert "gam" not in streamed

"""Incremental text equals a full decode; stop strings cut the text and never leak."""

from __future__ import annotations

import random

from common.detokenizer import IncrementalDetokenizer
from common.tokenizer import Tokenizer
from tests.common import made_tokenizers


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


def streamed_until_stopped(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    """The text a stream shows, one token at a time, until the detokenizer stops."""
    streamed = ""
    for token in ids:
        streamed += detok.add([token])
        if detok.stopped:
            break
    return streamed + detok.finish()


def test_stop_string_cuts_and_is_never_streamed(tiny_llama):
    tokenizer = Tokenizer(tiny_llama)
    ids = tokenizer.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["gamma", "zzz"])
    streamed = streamed_until_stopped(detok, ids)
    assert streamed == "alpha beta "
    assert detok.stop_string == "gamma"
    assert "gam" not in streamed


def test_an_included_stop_string_ends_the_text_streamed_or_not(tiny_llama):
    """vLLM's include_stop_str_in_output: the text ends with the stop string; what the
    same token decoded after it is still cut."""
    tokenizer = Tokenizer(tiny_llama)
    ids = tokenizer.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    for stop in ("gamma", "gam", "a gamma d"):
        detok = IncrementalDetokenizer(tokenizer, stop=[stop, "zzz"], include_stop=True)
        streamed = streamed_until_stopped(detok, ids)
        text = tokenizer.decode(ids)
        assert streamed == text[: text.index(stop) + len(stop)], stop
        assert detok.stop_string == stop


def test_of_two_stop_strings_beginning_together_the_first_listed_wins(tiny_llama):
    """Both complete in one token and begin at one character: the one listed first
    matches (as vLLM checks them), whichever sorts first."""
    tokenizer = Tokenizer(tiny_llama)
    ids = tokenizer.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    pieces = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    # A token whose text adds a 3+ character word whose first two characters occur
    # nowhere before it.
    end, word = next((i, piece.split()[-1]) for i, piece in enumerate(pieces)
                     if len(piece) - len(pieces[i - 1]) >= 3 and len(piece.split()[-1]) >= 3
                     and piece.split()[-1][:2] not in pieces[i - 1])  # fmt: skip
    for stops in ([word, word[:2]], [word[:2], word]):
        detok = IncrementalDetokenizer(tokenizer, stop=stops, include_stop=True)
        streamed = streamed_until_stopped(detok, ids)
        assert detok.stop_string == stops[0], (stops, detok.stop_string)
        assert streamed == pieces[end][: pieces[end].rindex(word)] + stops[0]


def test_special_tokens_text_is_kept_when_not_skipped(tiny_llama):
    """vLLM's skip_special_tokens false: special tokens decode to their text, streamed
    token by token as in one decode, and a stop string matches in that text."""
    tokenizer = Tokenizer(tiny_llama)
    start, end = tokenizer.token_id("<|im_start|>"), tokenizer.token_id("<|im_end|>")
    words = tokenizer.encode("alpha beta", add_special_tokens=False)
    ids = [start, *words, end, *words, start]
    skipped = IncrementalDetokenizer(tokenizer)
    assert "".join([skipped.add([t]) for t in ids] + [skipped.finish()]) == tokenizer.decode(ids)
    detok = IncrementalDetokenizer(tokenizer, skip_special=False)
    kept = "".join([detok.add([t]) for t in ids] + [detok.finish()])
    assert kept == tokenizer.decode(ids, skip_special_tokens=False)
    assert kept.count("<|im_start|>") == 2 and kept != tokenizer.decode(ids)
    stopped = IncrementalDetokenizer(tokenizer, stop=["<|im_end|>"], skip_special=False)
    assert streamed_until_stopped(stopped, ids) == tokenizer.decode(
        [start, *words], skip_special_tokens=False
    )
    # Skipped, the marker is no text a stop string could match.
    assert streamed_until_stopped(
        IncrementalDetokenizer(tokenizer, stop=["<|im_end|>"]), ids
    ) == tokenizer.decode(ids)
    # Nor is a marker a parser reads, unless special tokens are not skipped.
    kept = frozenset({end})
    marked = IncrementalDetokenizer(tokenizer, stop=["im_end"], keep_special=kept)
    streamed_until_stopped(marked, ids)
    assert not marked.stopped
    marked = IncrementalDetokenizer(tokenizer, stop=["im_end"], keep_special=kept,
                                    skip_special=False)  # fmt: skip
    assert streamed_until_stopped(marked, ids).endswith("alpha beta<|")


def test_stop_strings_wait_for_min_tokens(tiny_llama):
    """As in vLLM: a stop string inside the first min_tokens tokens does not stop the
    sequence, the next one does; the same whether tokens arrive one by one or at once."""
    tokenizer = Tokenizer(tiny_llama)
    text = "alpha beta gamma delta gamma epsilon"
    ids = tokenizer.encode(text, add_special_tokens=False)
    first_gamma_ends = next(
        n for n in range(1, len(ids) + 1) if "gamma" in tokenizer.decode(ids[:n])
    )
    for min_tokens, expected in ((0, "alpha beta "), (first_gamma_ends, "alpha beta gamma delta ")):
        for step in (1, len(ids)):
            detok = IncrementalDetokenizer(tokenizer, stop=["gamma"], min_tokens=min_tokens)
            streamed = ""
            for start in range(0, len(ids), step):
                streamed += detok.add(ids[start : start + step])
                if detok.stopped:
                    break
            streamed += detok.finish()
            assert (streamed, detok.stopped) == (expected, True), (min_tokens, step)


def test_a_longer_stop_string_does_not_let_a_short_one_match_inside_min_tokens(tiny_llama):
    """Each stop string is looked for from where it could first end after the exempt
    text: adding one that never occurs changes nothing (an audit saw a space inside the
    first min_tokens' text stop the sequence once a 10-character stop string was added)."""
    tokenizer = Tokenizer(tiny_llama)
    ids = tokenizer.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    min_tokens = next(n for n in range(1, len(ids)) if " " in tokenizer.decode(ids[:n]))
    texts = []
    for stop in ([" "], [" ", "ZZZZZZZZZQ"]):
        for step in (1, len(ids)):
            detok = IncrementalDetokenizer(tokenizer, stop=stop, min_tokens=min_tokens)
            streamed = ""
            for start in range(0, len(ids), step):
                streamed += detok.add(ids[start : start + step])
                if detok.stopped:
                    break
            texts.append(streamed + detok.finish())
    exempt = tokenizer.decode(ids[:min_tokens])
    assert texts[0].startswith(exempt) and texts == [texts[0]] * 4, texts


def test_a_completion_keeps_what_it_owes_to_the_prompt(tmp_path):
    """With a SentencePiece decoder that strips a sequence's first space (Llama 2,
    Mistral), the first generated token decoded alone lost its space: "...this isthe".
    Decoded after the prompt's last tokens, prompt + completion reads as one decode."""
    tokenizer = made_tokenizers.llama2_style(tmp_path)
    prompt = tokenizer.encode("Hello world, this is", add_special_tokens=False)
    generated = tokenizer.encode(" the quick 世界 fox", add_special_tokens=False)[1:]
    assert tokenizer.convert_ids_to_tokens(generated[:1]) == ["▁the"]
    expected = tokenizer.decode(prompt + generated)[len(tokenizer.decode(prompt)) :]
    assert expected.startswith(" the")
    for context in (prompt, [5, *prompt]):
        detok = IncrementalDetokenizer(tokenizer, context=context)
        assert "".join(detok.add([t]) for t in generated) + detok.finish() == expected
    # A prompt given as ids that ends inside a character: decoded without it.
    half = tokenizer.encode("世", add_special_tokens=False)[-2:]
    detok = IncrementalDetokenizer(tokenizer, context=prompt + half)
    assert "".join(detok.add([t]) for t in generated) + detok.finish() == tokenizer.decode(
        generated
    )


def test_a_prompt_ending_in_byte_tokens_keeps_the_replys_first_space(tmp_path):
    """A byte-fallback decoder reads a run of byte tokens that starts mid-character as
    replacement characters: the last 6 ids of a prompt ending in two emoji seemed to end
    inside one, the context was dropped, and the reply lost its first space ("Hello
    😀😀the test"; an audit). The window is widened to a character's start."""
    tokenizer = made_tokenizers.llama2_style(tmp_path / "llama2")
    generated = tokenizer.encode(" the test", add_special_tokens=False)[1:]
    for prompt_text in ("Hello 😀", "Hello 😀😀", "😀" * 5):
        prompt = tokenizer.encode(prompt_text)
        detok = IncrementalDetokenizer(tokenizer, context=prompt)
        streamed = "".join(detok.add([t]) for t in generated) + detok.finish()
        whole, before = tokenizer.decode(prompt + generated), tokenizer.decode(prompt)
        assert streamed == whole[len(before) :] == " the test", prompt_text


def test_a_long_reply_keeps_a_bounded_live_tail_and_its_stops(tiny_llama):
    """The text of a long reply is kept as finished pieces and a live tail a stop string
    can still cut (one growing string was copied whole every token: quadratic). Pieces,
    whole text and a stop string far into the reply, in every grouping of tokens, are
    what a one-string detokenizer gives."""
    tokenizer = Tokenizer(tiny_llama)
    rng = random.Random(3)
    ids = [rng.randrange(5, tokenizer.vocab_size) for _ in range(6000)]
    text = tokenizer.decode(ids)
    assert len(text) > 5 * 4096
    stop = text[4 * 4096 + 17 : 4 * 4096 + 29]
    for stops, group in (((), 1), ((), 7), ((stop, "\0never"), 1), ((stop,), 5)):
        detok = IncrementalDetokenizer(tokenizer, stop=stops, include_stop=bool(group % 2))
        pieces, live = [], 0
        for start in range(0, len(ids), group):
            pieces.append(detok.add(ids[start : start + group]))
            live = max(live, len(detok._live))
            if detok.stopped:
                break
        pieces.append(detok.finish())
        expected = text
        if stops:
            expected = text[: text.index(stop) + (len(stop) if group % 2 else 0)]
            assert detok.stop_string == stop
        assert "".join(pieces) == detok.text == expected, (stops, group)
        assert live < 2 * 4096 + 64, live  # the live tail, not the whole reply

"""The n-gram draft proposer: the longest suffix match, at its most recent occurrence."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.ngram_proposer import TokenHistory, propose_ngram


def brute_force(tokens: list[int], min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """The definition, one candidate at a time: for n from max_n down to min_n, the last
    earlier occurrence of the n-token suffix, and what followed it."""
    total = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= total:
            continue
        suffix = tokens[total - n :]
        for end in range(total - 2, n - 2, -1):  # the occurrence's last token, before ours
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + max_drafts]
    return []


def test_examples():
    seq = np.array([1, 2, 3, 4, 9, 2, 3, 4, 7, 8, 5, 3, 4], dtype=np.int64)
    # "3 4" last occurred before "7 8"; "2 3 4"-style longer matches do not end the sequence.
    assert propose_ngram(seq, 2, 4, 3) == [7, 8, 5]
    assert propose_ngram(seq, 2, 4, 1) == [7]
    assert propose_ngram(seq, 3, 4, 3) == []  # "5 3 4" never occurred before
    # The longest match wins over a more recent shorter one.
    seq = np.array([7, 1, 2, 10, 5, 2, 11, 7, 1, 2], dtype=np.int64)
    assert propose_ngram(seq, 1, 3, 2) == [10, 5]
    assert propose_ngram(seq, 1, 1, 2) == [11, 7]
    # Near the end a match has fewer followers than asked for.
    seq = np.array([4, 5, 4, 5], dtype=np.int64)
    assert propose_ngram(seq, 2, 2, 5) == [4, 5]
    assert propose_ngram(np.array([3], dtype=np.int64), 1, 2, 4) == []
    assert propose_ngram(np.array([3, 3], dtype=np.int64), 1, 2, 0) == []


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_definition(seed):
    rng = random.Random(seed)
    for _ in range(300):
        alphabet = rng.randint(2, 6)  # small: matches of every length occur
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 60))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        max_drafts = rng.randint(0, 6)
        got = propose_ngram(np.array(tokens, dtype=np.int64), min_n, max_n, max_drafts)
        assert got == brute_force(tokens, min_n, max_n, max_drafts), (tokens, min_n, max_n)


def test_history_copies_only_what_was_appended():
    history = TokenHistory()
    prompt, output = list(range(50)), []
    assert history.sync(prompt, output).tolist() == prompt
    for token in range(100, 300):
        output.append(token)
        view = history.sync(prompt, output)
        assert view.tolist() == prompt + output
    assert history.buffer.size < 2 * (len(prompt) + len(output))  # grown by doubling
    history.buffer[0] = -1  # a sync copies only the new tail: the old head stays as is
    output.append(7)
    assert history.sync(prompt, output)[0] == -1

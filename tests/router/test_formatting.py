"""Response bodies: a streamed completion's logprobs equal the whole response's."""

from __future__ import annotations

from types import SimpleNamespace

from proto import pdserve_pb2 as pb
from router.choices import Choice, ChoiceEvent
from router.formatting import Formatter

TOKEN_TEXT = {1: "ab", 2: "c", 3: "\ufffd", 4: "de", 5: "f"}


def _Text(text: str) -> SimpleNamespace:  # a finished detokenizer
    return SimpleNamespace(text=text)


def test_streamed_text_offsets_equal_the_whole_responses():
    """The text a chunk carries may lag its tokens (held back for a possible stop string
    or an incomplete character); offsets follow the tokens either way."""
    logprobs = [pb.TokenLogprobs(token_id=t, logprob=-0.5) for t in TOKEN_TEXT]
    # Text by chunk as a detokenizer holding back "c?" (a stop string's prefix) sends it.
    chunks = [([1], "ab"), ([2], ""), ([3], "c\ufffd"), ([4, 5], "def")]
    request = SimpleNamespace(prompt_token_ids=[7, 8])
    choice = Choice(0, 0, request, _Text("abc\ufffddef"), token_ids=list(TOKEN_TEXT),
                    logprobs=logprobs, finish_reason="length")  # fmt: skip
    streamed = Formatter("cmpl-1", "m", chat=False, logprobs=True, token_text=TOKEN_TEXT.get)
    offsets, position = [], 0
    for token_ids, text in chunks:
        lps = logprobs[position : position + len(token_ids)]
        position += len(token_ids)
        body = streamed.chunk(ChoiceEvent(choice, text, token_ids, lps))
        offsets += body["choices"][0]["logprobs"]["text_offset"]
    whole = Formatter("cmpl-2", "m", chat=False, logprobs=True, token_text=TOKEN_TEXT.get)
    final = whole.final([choice])["choices"][0]["logprobs"]
    assert offsets == final["text_offset"] == [0, 2, 3, 4, 6]

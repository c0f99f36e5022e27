"""A choice's text, finish reason and counts do not depend on how its tokens were grouped
into deltas (one per step, a prefill's first token then the rest, speculative drafts, a
slow reader's merged outputs), and a stop string found in text held back to the end still
ends the choice with ``stop``. The deltas are scripted here, for exact groupings: the
dispatcher they stand for is tested against real workers elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from common.detokenizer import IncrementalDetokenizer
from common.tokenizer import Tokenizer
from proto import pdserve_pb2 as pb
from router.choices import Choice, ChoiceEvent, run_choice
from router.dispatch import SequenceRequest, TokenDelta
from router.metrics import RouterMetrics
from tests.common import made_tokenizers


class Scripted:
    """Yields the given deltas for any request (what ``Dispatcher.generate`` yields)."""

    def __init__(self, deltas: list[TokenDelta]) -> None:
        self.deltas = deltas

    async def generate(self, request: SequenceRequest) -> AsyncIterator[TokenDelta]:
        for delta in self.deltas:
            yield delta


def run(tokenizer: Tokenizer, groups: list[list[int]], stop: list[str], min_tokens: int = 0,
        finish: str = "length") -> tuple[Choice, str]:  # fmt: skip
    """The choice after its deltas (each with a log-prob entry per token), and the text
    its events carried."""
    sampling = pb.SamplingParams(max_tokens=100, min_tokens=min_tokens)
    choice = Choice(0, 0, SequenceRequest("r", [1, 2, 3], [], sampling),
                    IncrementalDetokenizer(tokenizer, stop, min_tokens))  # fmt: skip
    deltas = [
        TokenDelta(group, [pb.TokenLogprobs(token_id=t) for t in group],
                   finish if last else None,
                   pb.Usage(prompt_tokens=3, completion_tokens=999) if last else None)
        for last, group in ((i == len(groups) - 1, g) for i, g in enumerate(groups))
    ]  # fmt: skip

    async def events() -> list[ChoiceEvent]:
        return [e async for e in run_choice(Scripted(deltas), choice, RouterMetrics("m"), 0.0)]

    shown = asyncio.run(events())
    assert sum(len(e.token_ids) for e in shown) == len(choice.token_ids) == len(choice.logprobs)
    return choice, "".join(e.text for e in shown)


def outcome(choice: Choice, text: str) -> tuple:
    assert choice.usage is not None
    return text, choice.finish_reason, choice.stop_reason, choice.usage.completion_tokens


@pytest.mark.parametrize(
    ("stop", "min_tokens"),
    [(["i 世", " "], 0), (["Hi"], 4), (["H", "界 a"], 1), (["世界 and"], 0), (["nope"], 2)],
)
def test_the_outcome_does_not_depend_on_how_tokens_were_grouped(tiny_llama, stop, min_tokens):
    """Decoded together, a group ending in half a character held back every character
    before it: the first ``min_tokens`` tokens' text ended late and a stop string matched
    inside it (an empty completion for ``min_tokens`` 4, stop "Hi"); and of two stop
    strings the one that began first won, not the one completed first. Tokens after the
    stop string are cut: the usage no longer counts a group's tail."""
    tokenizer = Tokenizer(tiny_llama)
    ids = tokenizer.encode("Hi 世界 and more", add_special_tokens=False)
    one_by_one = outcome(*run(tokenizer, [[t] for t in ids], stop, min_tokens))
    groupings = [[ids], [ids[:1], ids[1:]], [ids[i : i + 3] for i in range(0, len(ids), 3)]]
    for groups in groupings:
        assert outcome(*run(tokenizer, groups, stop, min_tokens)) == one_by_one, groups
    if stop == ["Hi"]:
        assert one_by_one[0] == "Hi 世界 and more"  # the exempt text holds the only "Hi"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> Tokenizer:
    return made_tokenizers.byte_level(tmp_path_factory.mktemp("byte_level"))


def test_a_stop_string_in_text_held_to_the_end_ends_the_choice_with_stop(byte_level):
    """The last token is " " plus half a character: held back (incomplete) until the
    choice ended at max_tokens, where the stop string " " was found and cut, but the
    choice said ``length`` with no ``stop_reason``."""
    mixed = [t for t in range(byte_level.vocab_size)
             if (text := byte_level.decode([t])).endswith("\ufffd") and text[0] == " "]  # fmt: skip
    assert mixed, "the vocabulary should merge a space with part of a character"
    (a,) = byte_level.encode("a", add_special_tokens=False)
    choice, text = run(byte_level, [[a], [mixed[0]]], stop=[" "])
    assert outcome(choice, text) == ("a", "stop", " ", 2)


def test_stop_reason_follows_vllms_order_of_checks(byte_level):
    """The tokenizer's EOS is checked first (None), then the request's stop tokens (their
    id), then the model's other EOS ids (their id); with ignore_eos only stop tokens
    count. An EOS the request also listed as a stop token said its id, vLLM None."""
    cases = [  # (stop_token_ids, ignore_eos, token) -> stop_reason
        ((), False, 2, None), ((2,), False, 2, None), ((2,), True, 2, 2),
        ((7,), False, 7, 7), ((), False, 9, 9), ((), True, 9, None), ((9,), True, 9, 9),
    ]  # fmt: skip
    for stop_token_ids, ignore_eos, token_id, reason in cases:
        sampling = pb.SamplingParams(stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        choice = Choice(0, 0, SequenceRequest("r", [1], [], sampling),
                        IncrementalDetokenizer(byte_level, [], 0),
                        eos_token_ids=frozenset({2, 9}), main_eos_id=2)  # fmt: skip
        assert choice.stop_reason_of(token_id) == reason, (stop_token_ids, ignore_eos, token_id)


def test_a_reader_that_falls_behind_holds_back_every_choice_of_its_request(byte_level):
    """Several choices merge through a queue: unbounded, it drained each choice's stream
    however slowly the client read, so the router held every choice's whole reply (n=8:
    +33 MB in 45 s of a client not reading). Bounded, each choice waits for the reader,
    as one choice's stream does (its decode worker is then held back by gRPC)."""
    from router.choices import merge_choices

    produced = [0, 0]

    class Counting:
        async def generate(self, request: SequenceRequest) -> AsyncIterator[TokenDelta]:
            for _ in range(500):
                produced[int(request.request_id)] += 1
                yield TokenDelta([7], [pb.TokenLogprobs(token_id=7)])

    sampling = pb.SamplingParams(max_tokens=1000)
    choices = [Choice(i, 0, SequenceRequest(str(i), [1, 2, 3], [], sampling),
                      IncrementalDetokenizer(byte_level, [], 0)) for i in range(2)]  # fmt: skip

    metrics = RouterMetrics("m")

    async def read_slowly() -> tuple[int, float | None]:
        events = merge_choices(Counting(), choices, metrics, 0.0)
        read = 0
        async for _ in events:
            read += 1
            if read == 5:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # a reader that stopped: the choices may not run ahead
        ahead = sum(produced) - read
        await events.aclose()
        # Both sequences ended with the merge (their aborts and metrics), not later.
        ended = metrics.registry.get_sample_value(
            "vllm:request_success_total", {"model_name": "m", "finished_reason": "abort"}
        )
        return ahead, ended

    ahead, ended = asyncio.run(read_slowly())
    assert ahead <= 2 * len(choices) + len(choices) and ended == 2

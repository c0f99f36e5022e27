"""A reasoning model's thinking, told apart from its answer (vLLM's ``--reasoning-parser``).

DeepSeek-R1, QwQ and Qwen3 think inside ``<think>...</think>`` before they answer. With a
parser configured (``router.reasoning_parser``) a chat reply carries the thinking in
``reasoning_content`` (and ``reasoning``, vLLM's newer name for it) and the answer alone
in ``content``, where tool calls are read from and a constraint applies.

Where the thinking starts depends on the chat template as much as on the model, so it is
read from the prompt's end first:

- the prompt ends with ``<think>`` (Qwen3-Thinking, DeepSeek-R1-0528): the output starts
  inside the thinking;
- the prompt ends with ``</think>`` (Qwen3 with ``enable_thinking: false``): no thinking;
- neither: ``deepseek_r1`` assumes the output starts thinking (R1 may or may not write
  the opening tag itself), ``qwen3`` that it thinks only if it opens with ``<think>``.

A reply that continues the last assistant message (``continue_final_message``) goes on
where that message stopped: inside its thinking if it opened ``<think>`` and did not
close it, in its answer if it closed it (a tag in any other message is text).

The thinking ends at the first ``</think>``; the answer is all that follows, whitespace
included (as vLLM's parsers leave it: a constraint's own leading blanks are the
answer's, and stripping could not tell them from the model's). Output that never closes
it (cut by ``max_tokens``) is all thinking, and ``content`` is null. One state machine
reads a whole text and a stream alike, so streamed deltas add up to the whole reply; it
holds back only what may be the start of a tag.
"""

from __future__ import annotations

from dataclasses import replace
from enum import Enum
from typing import Any

from common.router_config import ReasoningParser
from common.structured_output import StructuredOutput
from router.tags import partial_tag

START, END = "<think>", "</think>"
# Tokens of the prompt's end that are decoded to find a tag there (a tag is one token in
# the models that use it; a few more cover templates that put whitespace after it).
PROMPT_TAIL_TOKENS = 8


class Opening(Enum):
    """How an output begins, given its parser and its prompt."""

    THINKING = "thinking"  # inside the thinking (an opening tag of its own is dropped)
    MAYBE = "maybe"  # thinking if it opens with <think>, else answering
    ANSWER = "answer"  # no thinking


def opening_of(
    parser: ReasoningParser, prompt_tail: str, continued: str | None = None
) -> Opening | None:
    """None: no parser. ``prompt_tail`` is the end of the prompt's text; ``continued``
    the assistant message the reply continues (``continue_final_message``), if any."""
    if parser is ReasoningParser.NONE:
        return None
    if continued is not None:
        start, end = continued.rfind(START), continued.rfind(END)
        if start > end:
            return Opening.THINKING
        if end > start:
            return Opening.ANSWER
    tail = prompt_tail.rstrip()
    if tail.endswith(START):
        return Opening.THINKING
    if tail.endswith(END):
        return Opening.ANSWER
    return Opening.THINKING if parser is ReasoningParser.DEEPSEEK_R1 else Opening.MAYBE


class _Splitter:
    """One choice's text, read as it comes, into thinking and answer."""

    def __init__(self, opening: Opening) -> None:
        self.opening = opening
        self.state = "answer" if opening is Opening.ANSWER else "start"
        self.pending = ""
        self.thought = False  # entered the thinking

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(thinking, answer) to send for ``text`` (all that is held, when ``final``)."""
        self.pending += text
        thinking, answer = "", ""
        while True:
            if self.state == "start":
                if self.pending.startswith(START):
                    self.pending = self.pending[len(START) :]
                elif START.startswith(self.pending) and not final:
                    return thinking, answer  # may still become the opening tag
                elif self.opening is Opening.MAYBE:
                    self.state = "answer"
                    continue
                self.state, self.thought = "thinking", True
            elif self.state == "thinking":
                at = self.pending.find(END)
                if at < 0:
                    keep = 0 if final else partial_tag(self.pending, END)
                    cut = len(self.pending) - keep
                    thinking += self.pending[:cut]
                    self.pending = self.pending[cut:]
                    return thinking, answer
                thinking += self.pending[:at]
                self.pending = self.pending[at + len(END) :]
                self.state = "answer"
            else:
                answer += self.pending
                self.pending = ""
                return thinking, answer


class Reasoning:
    """The thinking of one chat response's choices (see the module docstring).
    ``include`` False (vLLM's ``include_reasoning``) drops it from the reply."""

    def __init__(self, opening: Opening, include: bool = True) -> None:
        self.opening = opening
        self.include = include
        self._splitters: dict[int, _Splitter] = {}

    def constrained(self, structured: StructuredOutput) -> StructuredOutput:
        """``structured`` applied after the thinking (``common/structured_output.py``)."""
        if self.opening is Opening.ANSWER:
            return structured
        optional = self.opening is Opening.MAYBE
        return replace(structured, reasoning_start=START, reasoning_end=END,
                       reasoning_optional=optional)  # fmt: skip

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(thinking, answer) of a whole text: thinking None where there was none,
        answer None where the text was all thinking."""
        splitter = _Splitter(self.opening)
        thinking, answer = splitter.feed(text, final=True)
        if not splitter.thought:
            return None, answer
        return thinking or None, answer or None

    def delta(self, index: int, text: str, final: bool) -> tuple[str, str]:
        """(thinking, answer) to stream for choice ``index``'s new ``text``."""
        splitter = self._splitters.setdefault(index, _Splitter(self.opening))
        return splitter.feed(text, final)

    def num_tokens(self, token_texts: list[str]) -> int:
        """How many of a choice's tokens are its thinking, tags included (OpenAI's
        ``completion_tokens_details.reasoning_tokens``). Read from the tokens' own texts,
        so a stop string that cut the reply's text changes nothing."""
        text = "".join(token_texts)
        if self.opening is Opening.ANSWER or (
            self.opening is Opening.MAYBE and not text.startswith(START)
        ):
            return 0
        at = text.find(END)
        end = len(text) if at < 0 else at + len(END)
        count, position = 0, 0
        while position < end:
            position += len(token_texts[count])
            count += 1
        return count

    def fields(self, thinking: str | None) -> dict[str, Any]:
        return reasoning_fields(thinking, self.include)


def reasoning_fields(thinking: str | None, include: bool) -> dict[str, Any]:
    """A reply's reasoning fields: both names, as clients read one or the other; none
    without thinking, or where the request asked to leave it out (``include`` False)."""
    if not include or not thinking:
        return {}
    return {"reasoning_content": thinking, "reasoning": thinking}

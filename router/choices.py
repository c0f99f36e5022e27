"""From an OpenAI request to sequences on the workers and back to text, per choice.

A request fans out into ``len(prompts) * n`` choices; each is one sequence for the
dispatcher. Its token deltas go through the choice's incremental detokenizer, which also
applies stop strings: a matched stop string ends the choice with ``stop`` and closes the
sequence (which aborts it on the decode worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from common.detokenizer import IncrementalDetokenizer
from common.hashing import hash_blocks, prefix_salt
from common.stop_reasons import ended_by_token, stop_reason_of
from proto import pdserve_pb2 as pb
from router.dispatch import Dispatcher, SequenceRequest
from router.errors import bad_request, context_too_long
from router.images import PromptImages
from router.metrics import RouterMetrics
from router.workers import LoraRef


@dataclass(slots=True)
class Choice:
    index: int
    prompt_index: int
    request: SequenceRequest
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    # vLLM's: what stopped it, once finish_reason is "stop": the stop string or stop token
    # id (None: EOS).
    stop_reason: int | str | None = None
    usage: pb.Usage | None = None
    cached_tokens: int = 0  # prompt tokens the worker reused, as soon as it says
    prompt_logprobs: list[pb.TokenLogprobs] | None = None  # prompt tokens 1.., when asked
    # ``echo`` with ``max_tokens`` 0: the choice ends at its first token (which carries the
    # prompt's log-probs) with nothing generated to show.
    echo_only: bool = False
    # The model's end-of-sequence ids (``ModelInfo.eos_token_ids``): one that ends the
    # choice is, like a stop token, not in its text. ``main_eos_id``: the tokenizer's.
    eos_token_ids: frozenset[int] = frozenset()
    main_eos_id: int | None = None

    def ended_by_token(self, token_id: int) -> bool:
        """``common.stop_reasons.ended_by_token`` for this choice."""
        return ended_by_token(token_id, self.request.sampling.stop_token_ids, self.eos_token_ids)

    def stop_reason_of(self, token_id: int) -> int | None:
        """``common.stop_reasons.stop_reason_of`` for this choice."""
        sampling = self.request.sampling
        return stop_reason_of(token_id, sampling.stop_token_ids, sampling.ignore_eos,
                              self.main_eos_id)  # fmt: skip


@dataclass(slots=True)
class ChoiceEvent:
    """New text of one choice; ``finish_reason`` set on its last event."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[pb.TokenLogprobs]
    finish_reason: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


T = TypeVar("T")

# Prompts longer than this (in all) have their blocks hashed on a thread (~0.12 ms per 1k
# tokens: 0.24 s for 2M ids on the event loop), for choices and pooled sequences alike.
THREADED_PROMPT_TOKENS = 16_384


async def hashing(prompts: Sequence[Sequence[int]], work: Callable[[], T]) -> T:
    """``work()``, which hashes the blocks of ``prompts``: on a thread past
    ``THREADED_PROMPT_TOKENS`` in all (off the event loop, where every other stream would
    wait for it), inline below (a thread hop costs more than it saves)."""
    if sum(map(len, prompts)) > THREADED_PROMPT_TOKENS:
        return await asyncio.to_thread(work)
    return work()


def build_choices(
    request_id: str,
    prompts: list[list[int]],
    n: int,
    sampling: pb.SamplingParams,
    stop: list[str],
    max_model_len: int,
    block_size: int,
    detokenizer_factory: Callable[[list[str], list[int]], IncrementalDetokenizer],
    cache_salt: str | None = None,
    lora: LoraRef | None = None,
    prompt_param: str = "prompt",
    priority: int = 0,
    echo_only: bool = False,
    eos_token_ids: frozenset[int] = frozenset(),
    main_eos_id: int | None = None,
    images: PromptImages | None = None,
    default_max_tokens: int | None = None,
) -> list[Choice]:
    """One choice per (prompt, sample); checks each prompt against the context limit, and
    ``min_tokens`` against what the context leaves when ``max_tokens`` is unset.
    ``lora``: the LoRA adapter every choice runs with (None: the base model).
    ``prompt_param`` names the request's prompt field in errors. ``priority``: every
    choice's (lower first). ``echo_only``: every choice ends at its first token, showing
    nothing generated (``echo`` with ``max_tokens`` 0). ``eos_token_ids``: the model's;
    ``main_eos_id``: the tokenizer's. ``images``: a chat prompt's (one prompt).
    ``default_max_tokens``: the limit of a request that sets none (generation_config's
    ``max_new_tokens``), at most what the context leaves, as vLLM's ``get_max_tokens``."""
    choices = []
    for prompt_index, prompt in enumerate(prompts):
        limit = sampling.max_tokens if sampling.HasField("max_tokens") else 0
        if len(prompt) + limit > max_model_len or len(prompt) >= max_model_len:
            # (echo with max_tokens 0 asked for no completion token: the one computed to
            # score the prompt is not the client's to count)
            shown = 0 if echo_only else limit
            raise context_too_long(len(prompt), shown, max_model_len, prompt_param)
        room = max_model_len - len(prompt)
        limited_by = f"what the context leaves after the {len(prompt)} prompt tokens"
        if default_max_tokens is not None and default_max_tokens < room:
            room = default_max_tokens
            limited_by = ("the checkpoint's max_new_tokens (generation_config.json) when "
                          "max_tokens is unset")  # fmt: skip
        if not sampling.HasField("max_tokens") and sampling.min_tokens > room:
            raise bad_request(
                f"min_tokens must be <= {room}, {limited_by}, got {sampling.min_tokens}",
                "min_tokens",
            )
        salt = prefix_salt(cache_salt, lora and lora.key)
        hashes = hash_blocks(prompt, block_size, salt, images=images.spans if images else ())
        for sample in range(n):
            params = pb.SamplingParams()
            params.CopyFrom(sampling)
            if not params.HasField("max_tokens"):
                params.max_tokens = room
            if not params.HasField("seed"):
                # Unseeded: a random seed of the router's. The workers' engines seed their
                # own draws alike (engine.seed), so choices placed on two workers would
                # sample the same; and so the prefill worker's first token, the decode
                # worker's rest and a migration's are one seeded sequence.
                params.seed = secrets.randbits(63)
            elif sample:
                # n seeded samples differ, reproducibly; wrapped to stay an int64
                params.seed = (params.seed + sample + 2**63) % 2**64 - 2**63
            index = prompt_index * n + sample
            choices.append(
                Choice(
                    index=index,
                    prompt_index=prompt_index,
                    request=SequenceRequest(
                        f"{request_id}-{index}",
                        prompt,
                        hashes,
                        params,
                        cache_salt,
                        lora,
                        priority,
                        images=images.messages if images else (),
                        sibling=sample > 0,
                    ),
                    detokenizer=detokenizer_factory(stop, prompt),
                    echo_only=echo_only,
                    eos_token_ids=eos_token_ids,
                    main_eos_id=main_eos_id,
                )
            )
    return choices


async def run_choice(
    dispatcher: Dispatcher, choice: Choice, metrics: RouterMetrics, arrival: float
) -> AsyncIterator[ChoiceEvent]:
    """The choice's events. Metrics count as tokens come (a prompt at its first token),
    and the sequence once it ends: by its finish reason, else ``abort`` (closed early: the
    client went away, a sibling choice failed) or ``error`` (this choice failed)."""
    last = first = None
    ended = "abort"
    generator = dispatcher.generate(choice.request)
    try:
        async for delta in generator:
            now = time.perf_counter()
            if delta.token_ids:
                if last is None:
                    first = now
                    metrics.ttft.observe(now - arrival)
                    metrics.prompt_tokens.inc(len(choice.request.prompt_token_ids))
                else:
                    metrics.itl.observe((now - last) / len(delta.token_ids))
                metrics.generation_tokens.inc(len(delta.token_ids))
                last = now
            if delta.cached_tokens is not None:
                choice.cached_tokens = delta.cached_tokens
            if delta.prompt_logprobs is not None:
                choice.prompt_logprobs = delta.prompt_logprobs
            if choice.echo_only and delta.token_ids:
                choice.finish_reason = "length"
                choice.usage = pb.Usage(prompt_tokens=len(choice.request.prompt_token_ids),
                                        cached_tokens=choice.cached_tokens)  # fmt: skip
                yield ChoiceEvent(choice, "", [], [], "length")
                return
            detok = choice.detokenizer
            finish = delta.finish_reason
            shown = delta.token_ids
            if finish == "stop" and shown and choice.ended_by_token(shown[-1]):
                end_id = shown[-1]
                choice.stop_reason = choice.stop_reason_of(end_id)
                # The ending token's text is not output (as in vLLM), unless asked for or an
                # EOS that is a marker a parser reads (Harmony's <|call|>, <|return|>).
                marker = (end_id in detok.keep_special
                          and end_id not in choice.request.sampling.stop_token_ids)  # fmt: skip
                if not detok.include_stop and not marker:
                    shown = shown[:-1]
            num_decoded = len(detok.token_ids)
            text = detok.add(shown)
            token_ids, logprobs = delta.token_ids, delta.logprobs
            if detok.stopped:
                # The tokens after the one that completed the stop string are cut with
                # their text: not output, not counted, their logprobs not shown (so the
                # usage does not depend on how many tokens a delta carried).
                num_kept = len(detok.token_ids) - num_decoded
                token_ids, logprobs = token_ids[:num_kept], logprobs[:num_kept]
            choice.token_ids.extend(token_ids)
            choice.logprobs.extend(logprobs)
            if finish or detok.stopped:
                text += detok.finish()
                by_string = detok.stopped  # (finish() may find it in text held back)
                if by_string:
                    finish = "stop"
                    choice.stop_reason = detok.stop_string
                choice.finish_reason = finish
                choice.usage = (delta.usage if not by_string else None) or pb.Usage(
                    prompt_tokens=len(choice.request.prompt_token_ids),
                    completion_tokens=len(choice.token_ids),
                    cached_tokens=choice.cached_tokens,
                )
                yield ChoiceEvent(choice, text, token_ids, logprobs, finish)
                return
            if text or token_ids:
                yield ChoiceEvent(choice, text, token_ids, logprobs)
    except Exception:
        ended = "error"
        raise
    finally:
        await generator.aclose()  # a stop string or a gone client: abort the sequence
        metrics.e2e.observe(time.perf_counter() - arrival)
        metrics.sequence_ended(choice.finish_reason or ended)
        if choice.finish_reason and not choice.echo_only and first is not None:
            metrics.sequence_served(len(choice.request.prompt_token_ids),
                                    choice.cached_tokens or 0, len(choice.token_ids),
                                    first - arrival, last - first)  # fmt: skip


async def merge_choices(
    dispatcher: Dispatcher, choices: list[Choice], metrics: RouterMetrics, arrival: float
) -> AsyncIterator[ChoiceEvent]:
    """Events of all choices as they come. Stopping the iteration cancels every choice;
    the first error of any choice is raised."""
    if len(choices) == 1:
        run = run_choice(dispatcher, choices[0], metrics, arrival)
        async with contextlib.aclosing(run):  # its finally aborts the sequence: now
            async for event in run:
                yield event
        return
    # Bounded: a client that stops reading holds each choice back at its decode worker
    # (gRPC flow control, then the worker's merged outputs), as one choice's stream is;
    # unbounded, the router buffered every choice's whole reply (n=8: +33 MB in 45 s).
    queue: asyncio.Queue[ChoiceEvent | BaseException | None] = asyncio.Queue(2 * len(choices))

    async def pump(choice: Choice) -> None:
        """Its events, then None or its error (not when cancelled: nobody reads then, and
        a full queue would hold the cancelled task for good)."""
        run = run_choice(dispatcher, choice, metrics, arrival)
        try:
            # Closed with the pump: cancelled while waiting to put, it left the choice's
            # generator suspended, its sequence's abort and metrics left to the collector.
            async with contextlib.aclosing(run):
                async for event in run:
                    await queue.put(event)
        except Exception as exc:  # an APIError, or a bug to raise
            await queue.put(exc)
        else:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(choice)) for choice in choices]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

"""proto ↔ engine types, at the service boundary and nowhere else."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict, fields
from typing import Any

from common.multimodal import ImageInput
from common.structured_output import STRUCTURED_OUTPUT, StructuredOutput, StructuredOutputError
from engine.errors import InvalidSamplingParamsError
from engine.outputs import RequestOutput
from engine.request import RequestTimes, TokenLogprobs
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb


def optional(message: Any, field: str) -> Any:
    """A proto3 ``optional`` field's value; None when unset."""
    return getattr(message, field) if message.HasField(field) else None


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises ``InvalidSamplingParamsError`` for out-of-range values."""
    structured = None
    if msg.HasField("structured_output"):
        try:
            given = msg.structured_output
            names = (f.name for f in fields(StructuredOutput))
            structured = StructuredOutput(**{name: getattr(given, name) for name in names})
        except StructuredOutputError as error:
            raise InvalidSamplingParamsError(str(error), STRUCTURED_OUTPUT) from error
    return SamplingParams(
        max_tokens=optional(msg, "max_tokens"),
        min_tokens=msg.min_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        seed=optional(msg, "seed"),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=optional(msg, "logprobs"),
        prompt_logprobs=optional(msg, "prompt_logprobs"),
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        min_p=msg.min_p,
        logit_bias=dict(msg.logit_bias),
        allowed_token_ids=tuple(msg.allowed_token_ids) or None,
        bad_words_token_ids=tuple(tuple(word.token_ids) for word in msg.bad_words_token_ids),
        structured_output=structured,
    )


def images_from_proto(images: Sequence[pb.Image]) -> list[ImageInput]:
    """A request's images (``common/multimodal.py``); the engine checks them."""
    return [ImageInput(image.offset, image.data) for image in images]


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        min_tokens=params.min_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
        logit_bias=dict(params.logit_bias),
        allowed_token_ids=params.allowed_token_ids or (),
        bad_words_token_ids=[pb.TokenIds(token_ids=word) for word in params.bad_words_token_ids],
    )
    if params.max_tokens is not None:
        msg.max_tokens = params.max_tokens
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.structured_output is not None:
        msg.structured_output.CopyFrom(pb.StructuredOutput(**asdict(params.structured_output)))
    return msg


def prompt_logprobs_to_proto(output: RequestOutput) -> list[pb.TokenLogprobs]:
    """Prompt tokens 1.. scored (the engine's leading None has no wire form)."""
    scored = output.prompt_logprobs or []
    return [logprobs_to_proto(lp) for lp in scored if lp is not None]


async def add_prompt_logprobs(field: Any, output: RequestOutput) -> None:
    """Extend the repeated ``field`` with ``output``'s prompt log-probs, built on a thread
    when there are any: a 32k-token prompt's top-20 took 0.25 s, 100k's 0.8 s, on the
    service's event loop, where no other call of the worker was answered meanwhile."""
    if output.prompt_logprobs:
        await asyncio.to_thread(lambda: field.extend(prompt_logprobs_to_proto(output)))


def logprobs_to_proto(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top_token_ids=list(lp.top_token_ids),
        top_logprobs=list(lp.top_logprobs),
    )


def _ms(start: float | None, end: float | None) -> float:
    return (end - start) * 1000.0 if start is not None and end is not None else 0.0


def timings_to_proto(times: RequestTimes | None) -> pb.StageTimings:
    if times is None:
        return pb.StageTimings()
    decode_start = times.fetch_finished or times.first_token
    return pb.StageTimings(
        queue_ms=_ms(times.arrival, times.first_scheduled or times.fetch_started),
        prefill_ms=_ms(times.first_scheduled, times.first_token),
        transfer_ms=_ms(times.fetch_started, times.fetch_finished),
        decode_ms=_ms(decode_start, times.finished),
    )


def usage_to_proto(output: RequestOutput) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=output.outputs[0].num_tokens,
        cached_tokens=output.num_cached_tokens,
    )

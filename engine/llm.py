"""The offline API, shaped like vLLM's ``LLM``: batch in, outputs in input order out.

from engine import LLM, SamplingParams
llm = LLM(model="/path/to/checkpoint", max_num_seqs=32)
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
vectors = [o.embedding for o in llm.embed(["Hello"])]

A vision-language model's prompt is a dict, as vLLM's: ``{"prompt": "USER: <image>\nWhat
is this? ASSISTANT:", "multi_modal_data": {"image": [png_bytes_or_PIL_image]}}`` (or
``prompt_token_ids``), with one image token in the text per image. ``llm.chat(messages)``
takes OpenAI-style messages through the chat template, images as content parts.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.detokenizer import IncrementalDetokenizer
from common.engine_config import EngineConfig
from common.generation_config import GenerationDefaults
from common.multimodal import (
    ImageInput,
    ImageText,
    data_url_bytes,
    image_offsets,
    image_token_counts,
    render_with_images,
)
from common.stop_reasons import ended_by_token, stop_reason_of
from common.tokenizer import Tokenizer
from engine.attention.registry import create_backend, resolve_backend_name
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.pooling import EMBEDDING_SAMPLING, PoolingParams
from engine.resolve import resolve_device
from engine.sampling_params import SamplingParams

# Text, token ids, or a dict with "prompt" or "prompt_token_ids" and "multi_modal_data".
Prompt = str | Sequence[int] | Mapping[str, Any]


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _check_runnable(config: EngineConfig) -> None:
    """``ConfigError`` for a device or an attention backend this machine cannot run (the
    engine says so too, once the model is there). The demo model is a Llama: no latent
    attention changes the backend ``auto`` picks."""
    device = resolve_device(config)
    create_backend(resolve_backend_name(config.attention_backend, device), device,
                   config.block_size)  # fmt: skip


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        lora_adapters: Mapping[str, str | Path] | None = None,
        **engine_overrides: Any,
    ) -> None:
        """``model``: a local Hugging Face checkpoint directory; None makes and uses the
        built-in demo model. ``lora_adapters``: name -> PEFT adapter directory, for
        ``generate(lora_name=...)``. Keyword arguments override ``EngineConfig`` fields."""
        config = EngineConfig().replace(**engine_overrides)
        if model is None:
            from engine.models.maker import ensure_model

            _check_runnable(config)  # before seconds of making the demo model
            model = ensure_model()
        self.model_dir = Path(model)
        adapters = {name: Path(path) for name, path in (lora_adapters or {}).items()}
        self.engine = LLMEngine(model, config, lora_adapters=adapters)
        self.tokenizer = Tokenizer(model)
        self._image_text_cache: ImageText | None = None
        self._next_id = 0

    def close(self) -> None:
        """Stop the engine's tensor-parallel processes, if any (idempotent)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def load_lora_adapter(self, name: str, path: str | Path) -> bool:
        """Serve the PEFT adapter at ``path`` as ``name`` from now on; False if these very
        files were loaded under it already. Another adapter under the name is an
        ``InvalidRequestError`` (``unload_lora_adapter`` it first)."""
        return self.engine.add_lora_adapter(self.engine.read_lora_adapter(name, path))

    def unload_lora_adapter(self, name: str) -> bool:
        """Stop serving adapter ``name``; False if it was not loaded."""
        return self.engine.unload_lora_adapter(name)

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the checkpoint's generation_config.json defaults (as
        vLLM's ``LLM.get_default_sampling_params``)."""
        defaults = dataclasses.asdict(GenerationDefaults.read(self.model_dir))
        return SamplingParams(
            **{key: value for key, value in defaults.items() if value is not None}
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_name: str | Sequence[str | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids). Outputs come back in
        input order with ``text`` decoded, a prompt's ``n`` samples in its ``outputs``.
        Invalid input raises before anything runs. ``lora_name``: the adapter of every
        prompt, or one per prompt (None: the base). ``priority``: one per prompt, lower
        first (``scheduling_policy: priority``)."""
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"{len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        token_lists, lora_names, image_lists = self._prepare(prompt_list, lora_name)
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"{len(priorities)} priorities for {len(prompt_list)} prompts")
        priorities = [self.engine.validate_priority(value) for value in priorities]
        parent_ids = [self._new_id() for _ in prompt_list]
        samples: list[list[_Sample]] = []
        requests = []
        for i, (params, parent_id) in enumerate(zip(params_list, parent_ids, strict=True)):
            samples.append([])
            for index in range(params.n):
                request_id = parent_id if params.n == 1 else f"{parent_id}-{index}"
                detokenizer = self._detokenizer(params, token_lists[i])
                samples[-1].append(_Sample(request_id, index, params, detokenizer,
                                           self.engine.eos_token_ids,
                                           self.tokenizer.eos_token_id))  # fmt: skip
                one = dataclasses.replace(params, n=1, stop=(), include_stop_str_in_output=False,
                                          seed=_sample_seed(params.seed, index))  # fmt: skip
                requests.append((request_id, token_lists[i], one, lora_names[i],
                                 priorities[i], image_lists[i]))  # fmt: skip
        self._add_all(
            lambda request_id, tokens, params, name, value, images: self.engine.add_request(
                request_id, tokens, params, lora_name=name, priority=value, images=images
            ),
            requests,
        )
        by_id = {sample.request_id: sample for group in samples for sample in group}
        self._run(list(by_id), use_tqdm, lambda output: by_id[output.request_id].read(output))
        return [
            _combined(parent_id, [sample.output for sample in group], prompt)  # type: ignore[misc]
            for parent_id, group, prompt in zip(parent_ids, samples, prompt_list, strict=True)
        ]

    def _new_id(self) -> str:
        request_id = f"offline-{self._next_id}"
        self._next_id += 1
        return request_id

    def _detokenizer(
        self, params: SamplingParams, prompt_token_ids: list[int]
    ) -> IncrementalDetokenizer:
        """A sample's text as the router makes it (``common/detokenizer.py``): decoded
        after the prompt's last tokens (alone, a SentencePiece tokenizer's completion lost
        its first space: "the" for " the"), stop strings looked for as tokens come."""
        return IncrementalDetokenizer(
            self.tokenizer, params.stop, params.min_tokens,
            include_stop=params.include_stop_str_in_output, context=prompt_token_ids,
        )  # fmt: skip

    def _add_all(self, add: Any, requests: list[tuple]) -> None:
        """``add(request_id, *rest)`` for every ``(request_id, *rest)``, all or none: the
        checks only ``add_request`` makes (ids in the vocabulary, a grammar that compiles)
        failing on the k-th left the earlier ones queued, run by the next ``generate`` for
        nobody."""
        added: list[str] = []
        try:
            for request_id, *rest in requests:
                add(request_id, *rest)
                added.append(request_id)
        except BaseException:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: a conversation (OpenAI-style message dicts), or a list of
        them, through the checkpoint's chat template, then ``generate``. A message's
        content may be parts: ``{"type": "text", "text": ...}``, and for a vision-language
        model ``{"type": "image_url", "image_url": {"url": "data:..."}}`` (or the URL
        alone) and ``{"type": "image", "image": bytes_or_PIL_image}``. Nothing is fetched
        from the network: http(s) image URLs are refused."""
        if messages and isinstance(messages[0], Mapping):
            messages = [messages]  # type: ignore[list-item]
        prompts = [
            self._chat_prompt(list(conversation), add_generation_prompt, chat_template_kwargs)
            for conversation in messages
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_name=lora_name)

    def _chat_prompt(
        self,
        conversation: list[Mapping[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """A conversation as a ``generate`` prompt: its template's ids (each image's
        sequence in place: ``ImageText``) and its images, as encoded files."""
        images: list[Any] = []
        kinds: list[list[tuple[str, str]]] = []  # per message: (kind, text) of its parts
        for message in conversation:
            content = message.get("content")
            if not isinstance(content, list):
                kinds.append([("text", content or "")])
                continue
            parts = []
            for part in content:
                kind = part.get("type")
                if kind == "text":
                    parts.append(("text", part["text"]))
                elif kind in ("image_url", "image"):
                    images.append(_image_bytes(_chat_image(part)))
                    parts.append(("image", ""))
                else:
                    raise ValueError(f"content parts of type {kind!r} are not supported")
            kinds.append(parts)

        vision = self.engine.arch.vision
        image_text = self._image_text() if images and vision is not None else None
        counts = image_token_counts(vision, images) if image_text else []

        def render(marker: str | None) -> list[int]:
            """``render_with_images``' renderer: parts, or the marker in strings."""
            rendered = []
            for message, parts in zip(conversation, kinds, strict=True):
                content: Any
                if marker is None and any(kind == "image" for kind, _ in parts):
                    content = [
                        {"type": "image"} if kind == "image" else {"type": "text", "text": text}
                        for kind, text in parts
                    ]
                else:
                    written = marker or ""
                    content = "".join(written if kind == "image" else text for kind, text in parts)
                rendered.append({**message, "content": content})
            return self.tokenizer.apply_chat_template(
                rendered, add_generation_prompt, template_kwargs=dict(template_kwargs or {}),
                rewrite=None if image_text is None
                else lambda text: image_text.expand(text, counts),
            )  # fmt: skip

        if image_text is not None:  # the ids hold the images' sequences already
            token_ids = render_with_images(render, image_text.marker, (ValueError,))
        else:  # no images, or a model without an encoder (``generate`` refuses them)
            token_ids = render("")
        return {"prompt_token_ids": token_ids, "multi_modal_data": {"image": images}}

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """The embedding of every prompt (``RequestOutput.embedding``: the last token's
        hidden state, unit length unless ``pooling`` says not, or its logits at
        ``pooling.token_ids``; ``engine/pooling.py``), in input order. Meaningful for
        embedding checkpoints (Qwen3-Embedding, say); any checkpoint gives its hidden
        states. Invalid input raises before anything runs."""
        prompt_list = _normalize_prompts(prompts)
        token_lists, lora_names, image_lists = self._prepare(prompt_list, lora_name)
        request_ids = [self._new_id() for _ in prompt_list]
        self._add_all(
            lambda request_id, tokens, name, images: self.engine.add_request(
                request_id, tokens, EMBEDDING_SAMPLING, lora_name=name,
                pooling=pooling or PoolingParams(), images=images,
            ),
            list(zip(request_ids, token_lists, lora_names, image_lists, strict=True)),
        )  # fmt: skip
        finished = self._run(request_ids, use_tqdm, lambda output: output if output.finished
                             else None)  # fmt: skip
        outputs = [finished[request_id] for request_id in request_ids]
        for output, prompt in zip(outputs, prompt_list, strict=True):
            output.prompt = _prompt_text(prompt)
        return outputs

    def _prepare(
        self, prompts: list[Prompt], lora_name: str | Sequence[str | None] | None
    ) -> tuple[list[list[int]], list[str | None], list[tuple]]:
        """Each prompt's token ids, adapter and prepared images, checked (raises before
        anything runs)."""
        with_images = [self._with_images(p) for p in prompts]
        token_lists = [tokens for tokens, _ in with_images]
        if lora_name is None or isinstance(lora_name, str):
            lora_names = [lora_name] * len(prompts)
        else:
            lora_names = list(lora_name)
            if len(lora_names) != len(prompts):
                raise ValueError(f"{len(lora_names)} lora names for {len(prompts)} prompts")
        for tokens in token_lists:
            self.engine.validate_prompt(tokens)
        for name in lora_names:
            self.engine.lora_adapter(name)
        image_lists = [self.engine.prepare_images(t, i) for t, i in with_images]
        return token_lists, lora_names, image_lists

    def _with_images(self, prompt: Prompt) -> tuple[list[int], list[ImageInput]]:
        """A prompt's token ids, each image marker made its image's sequence (unless a
        prompt of ids holds the sequences already), and its images placed on them."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), []
        if not isinstance(prompt, Mapping):
            return list(prompt), []
        images = (prompt.get("multi_modal_data") or {}).get("image", [])
        images = images if isinstance(images, list | tuple) else [images]
        # Ids first, as vLLM: beside them, "prompt" is only their text (it was encoded
        # again, and the ids given ignored).
        by_text = "prompt_token_ids" not in prompt
        if by_text:
            tokens = [] if images else self.tokenizer.encode(prompt["prompt"])
        else:
            tokens = list(prompt["prompt_token_ids"])
        vision = self.engine.arch.vision
        if not images:  # placeholders without images are refused by ``prepare_images``
            return tokens, []
        if vision is None:
            raise ValueError(f"{self.engine.model_dir.name} takes no images")
        data = [_image_bytes(image) for image in images]
        counts = image_token_counts(vision, data)
        if by_text:  # markers become the images' sequences before tokenizing
            tokens = self.tokenizer.encode(self._image_text().expand(prompt["prompt"], counts))
        elif tokens.count(vision.image_token_id) != sum(counts):
            tokens = self._image_text().expand_ids(tokens, counts)  # not expanded yet
        offsets = image_offsets(tokens, vision.image_token_id, counts)
        return tokens, [ImageInput(o, d) for o, d in zip(offsets, data, strict=True)]

    def _image_text(self) -> ImageText:
        """How prompts hold this vision model's images (computed once). Raises
        ``ValueError`` when its tokenizer lacks the image tokens."""
        if self._image_text_cache is None:
            vision = self.engine.arch.vision
            assert vision is not None
            self._image_text_cache = ImageText.of(vision, self.tokenizer)
        return self._image_text_cache

    def _run(
        self,
        request_ids: list[str],
        use_tqdm: bool,
        read: Callable[[RequestOutput], RequestOutput | None],
    ) -> dict[str, RequestOutput]:
        """Step until every request ended; each one's final output, by id. ``read``
        takes each output as it comes and returns the request's final output once it
        ended, which may be before the engine finished it (a stop string): it is
        aborted then."""
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.request_id in finished:
                        continue
                    final = read(output)
                    if final is None:
                        continue
                    finished[output.request_id] = final
                    bar.update(1)
                    if not output.finished:
                        self.engine.abort_request(output.request_id)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return finished


@dataclasses.dataclass(slots=True)
class _Sample:
    """One sequence of an offline prompt: its engine request and its text so far."""

    request_id: str
    index: int  # among the prompt's n
    params: SamplingParams  # the prompt's (n, stop strings)
    detokenizer: IncrementalDetokenizer
    eos_token_ids: frozenset[int]  # the engine's (generation_config's too)
    main_eos_id: int | None  # the tokenizer's
    num_read: int = 0  # tokens of the engine's output read so far
    output: RequestOutput | None = None  # the final one, once ended

    def read(self, output: RequestOutput) -> RequestOutput | None:
        """Take the engine's latest output; the final one once the sequence ended, as
        the router ends it (``router/choices.py``): the token that stopped it has no
        text (unless ``include_stop_str_in_output``) and vLLM's ``stop_reason``; a stop
        string ends it at the token that completed it, the tokens after it (a step's
        speculated ones) dropped, its text cut before it."""
        completion = output.outputs[0]
        params, detokenizer = self.params, self.detokenizer
        new_ids = completion.token_source[self.num_read : completion.num_tokens]
        num_before = self.num_read
        self.num_read = completion.num_tokens
        shown, stop_reason = new_ids, completion.stop_reason
        ended = output.finished and completion.finish_reason == "stop" and shown
        if ended and ended_by_token(shown[-1], params.stop_token_ids, self.eos_token_ids):
            stop_reason = stop_reason_of(
                shown[-1], params.stop_token_ids, params.ignore_eos, self.main_eos_id
            )
            if not params.include_stop_str_in_output:
                shown = shown[:-1]
        num_decoded = len(detokenizer.token_ids)
        detokenizer.add(shown)
        if detokenizer.stopped:  # the tokens after the one that completed it are dropped
            completion.num_tokens = num_before + len(detokenizer.token_ids) - num_decoded
        if not output.finished and not detokenizer.stopped:
            return None
        detokenizer.finish()  # (which may find a stop string in the text held back)
        if detokenizer.stopped:
            completion.finish_reason, stop_reason = "stop", detokenizer.stop_string
        completion.num_logprobs = min(completion.num_logprobs, completion.num_tokens)
        completion.index, completion.stop_reason = self.index, stop_reason
        completion.text = detokenizer.text
        output.finished = True
        self.output = output
        return output


def _sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of a prompt's sample ``index``: the router's (``router/choices.py``), so
    that n seeded samples differ, reproducibly, and equal a server's; wrapped to stay an
    int64. Sample 0 keeps the prompt's."""
    if seed is None or index == 0:
        return seed
    return (seed + index + 2**63) % 2**64 - 2**63


def _prompt_text(prompt: Prompt) -> str | None:
    if isinstance(prompt, Mapping):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _combined(request_id: str, outputs: list[RequestOutput], prompt: Prompt) -> RequestOutput:
    """A prompt's samples as one output (vLLM's ``n``): the first's, every sample's
    completion in ``outputs`` in index order, cached tokens the least any had."""
    first = outputs[0]
    first.outputs = [output.outputs[0] for output in outputs]
    first.num_cached_tokens = min(output.num_cached_tokens for output in outputs)
    first.request_id = request_id
    first.prompt = _prompt_text(prompt)
    return first


def _chat_image(part: Mapping[str, Any]) -> Any:
    """A chat content part's image: a data: URL's bytes, or the part's bytes or image."""
    if part.get("type") == "image":
        return part["image"]
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, Mapping) else url
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError("offline, an image_url must be a data: URL (nothing is fetched)")
    return data_url_bytes(url)


def _image_bytes(image: Any) -> bytes:
    """An encoded image file: bytes as they are, a Pillow image as PNG (lossless)."""
    if isinstance(image, bytes | bytearray):
        return bytes(image)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()

"""A request's prompt fields as token ids: texts tokenized (off the event loop, by the
callers), chat messages through the template, ``truncate_prompt_tokens`` applied, and
each refusal an ``APIError`` naming the field it blames."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from common.multimodal import ImageText, render_with_images
from common.tokenizer import KeptTokens, Tokenizer, TokenizerError, TooManyTokens
from router.errors import APIError, bad_request, context_too_long
from router.protocol import CompletionRequest, texts_of, token_lists_of


def tool_dicts(tools) -> list[dict[str, Any]] | None:
    """Tools as chat templates see them (OpenAI's shape)."""
    return [tool.model_dump(exclude_none=True) for tool in tools or ()] or None


class PromptTokenizer:
    """Tokenizing for the routes, against the served model's context (``max_model_len``).
    Every method may take a while on a long text: callers run them in a thread."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        escape_special: bool = True,
        image_text: ImageText | None = None,
    ) -> None:
        """``escape_special``: chat text that spells a special token stays text
        (``router.parse_special_tokens_in_messages`` false), but for a vision model's
        image tokens (``image_text``, how its prompts hold images): those are the router's
        to count, and a prompt that spells them is refused (``router/images.py``)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.escape_special = escape_special
        self.image_text = image_text
        self.keep_special = frozenset()
        if image_text is not None:
            spelled = (image_text.marker, image_text.lead, image_text.placeholder,
                       image_text.tail)  # fmt: skip
            self.keep_special = tokenizer.special_texts_in("".join(spelled))

    def ids(
        self,
        value: str | list,
        param: str,
        limit: int | None,
        add_special_tokens: bool = True,
        kept: KeptTokens | None = None,
    ) -> list[list[int]]:
        """A prompt field's ids (``prompt``, ``input``: a text, texts, ids or lists of
        ids): texts encoded, the first past ``limit`` tokens refused at once (one surely
        past it before it is encoded whole), each checked to be non-empty and in the
        vocabulary, blaming ``param``. ``kept``: what truncation will keep of each (only
        that much of a text is tokenized)."""
        texts = texts_of(value)
        if texts is not None:
            prompts = []
            for text in texts:
                try:
                    tokens = self.tokenizer.encode(text, add_special_tokens, limit, kept)
                except TooManyTokens as exc:
                    raise self.too_long(exc, param) from None
                if limit is not None and len(tokens) > limit:  # not after 1,000 more texts
                    raise context_too_long(len(tokens), None, limit, param)
                prompts.append(tokens)
        else:
            prompts = token_lists_of(value)
        vocab = self.tokenizer.vocab_size
        for tokens in prompts:
            if not tokens:
                raise bad_request(f"{param} must not be empty", param)
            if any(t < 0 or t >= vocab for t in tokens):
                raise bad_request(f"{param} token ids must be in [0, {vocab})", param)
        return prompts

    def completion(self, body: CompletionRequest) -> list[list[int]]:
        """A completion's prompts, before truncation keeps its window of each."""
        return self.ids(body.prompt, "prompt", self.limit(body), kept=self.window(body))

    def chat(
        self, messages, add_generation_prompt: bool, tools=None, template_kwargs=None,
        continue_final_message: bool = False, max_tokens: int | None = None,
        kept: KeptTokens | None = None, image_text: str | None = None,
        image_parts: bool = False, rewrite: Callable[[str], str] | None = None,
        too_long: Callable[[TooManyTokens, str], APIError] | None = None,
    ) -> list[int]:  # fmt: skip
        """The messages through the chat template, as ids. ``max_tokens``: a longer
        prompt is refused before it is tokenized whole (as ``too_long`` says, by default
        as a prompt past the context). ``kept``: what truncation will
        keep (only that much of the text is tokenized). ``image_text``, ``image_parts``:
        how images reach the template (``ChatMessage.for_template``; neither: refused);
        ``rewrite``: what the rendered text goes through before it is tokenized (its
        ``ValueError`` is a 400)."""
        try:
            return self.tokenizer.apply_chat_template(
                [m.for_template(image_text, image_parts) for m in messages],
                add_generation_prompt, tools, template_kwargs, continue_final_message,
                max_tokens, kept, rewrite, self.escape_special, self.keep_special,
            )  # fmt: skip
        except TooManyTokens as exc:
            raise (too_long or self.too_long)(exc, "messages") from None
        except TokenizerError as exc:
            raise bad_request(str(exc), exc.param or "messages") from None
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None

    def chat_images(self, counts: Sequence[int], *args) -> list[int]:
        """``chat(*args)`` of messages with images of ``counts`` placeholders each, each
        written as its marker and made its sequence in the text (``self.image_text``). Images
        reach the template as content parts (what vision models' templates read); a
        template that does not write the marker for each (one that reads content as a
        string, or fails on a list) gets the marker's text in the string."""

        image_text = self.image_text
        assert image_text is not None, "a model without images"

        def render(marker: str | None) -> list[int]:
            return self.chat(
                *args, image_text=marker, image_parts=marker is None,
                rewrite=lambda text: image_text.expand(text, counts),
            )  # fmt: skip

        return render_with_images(render, image_text.marker, (APIError,))

    def limit(self, body) -> int | None:
        """How many tokens a prompt may have before it is refused untokenized: the
        context, unless the request truncates its prompt to fit."""
        return self.max_model_len if body.truncate_prompt_tokens is None else None

    def window(self, body) -> KeptTokens | None:
        """vLLM's ``truncate_prompt_tokens``: what it keeps of each prompt's tokens, the
        last ``keep`` (-1: as many as the context holds), cut after the chat template, or
        the first ones where ``truncation_side`` is "right"; None when the request does
        not truncate."""
        if body.truncate_prompt_tokens is None:
            return None
        keep = self.keep(body.truncate_prompt_tokens)
        return KeptTokens(keep, from_end=body.truncation_side != "right")

    def keep(self, truncate_prompt_tokens: int) -> int:
        """``truncate_prompt_tokens`` as a number of tokens (-1: the context's)."""
        if truncate_prompt_tokens > self.max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens must be <= max_model_len={self.max_model_len} "
                f"(or -1), got {truncate_prompt_tokens}",
                "truncate_prompt_tokens",
            )
        return self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens

    def too_long(self, exc: TooManyTokens, param: str) -> APIError:
        return context_too_long(exc.at_least, None, self.max_model_len, param, at_least=True)

"""Train a byte-level BPE tokenizer offline, on text that ships with Python itself.

No downloads: the corpus is the source of a fixed list of standard-library modules (code
and English docstrings), read from this interpreter's installation. The same Python
version gives the same tokenizer.
"""

from __future__ import annotations

import functools
import sysconfig
from collections.abc import Iterator
from pathlib import Path

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END]

# ChatML; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen3's thinking tags: ordinary added tokens (not special: they stay in decoded text).
THINK_TOKENS = ["<think>", "</think>"]
# ChatML whose generation prompt opens the thinking, as Qwen3-Thinking's does; the
# request's chat_template_kwargs ``enable_thinking: false`` closes it empty instead, as
# Qwen3's does.
THINKING_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% else %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)

# Mistral's tool-call markers (router/tool_parsers.py reads them).
MISTRAL_TOOL_TOKENS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]
# DeepSeek-V3's tool-call markers (special tokens here, so the router must keep them).
DEEPSEEK_TOOL_TOKENS = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                        "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                        "<｜tool▁sep｜>"]  # fmt: skip

# GPT-OSS's Harmony format (router/harmony.py reads it): its markers, special tokens as in
# the real tokenizer, and a template in its shape: a system message with the reasoning
# effort, a developer message with the instructions and the tools, the turns, and a
# generation prompt that opens an assistant message's header. Past turns' thinking is
# kept only where it led to their tool calls, as the real template keeps it.
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>"]  # fmt: skip
HARMONY_CHAT_TEMPLATE = """\
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n' }}
{{- 'Reasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + '\n\n' }}
{{- '# Valid channels: analysis, commentary, final.' }}
{%- if tools %}{{- ' Calls to these tools must go to the commentary channel.' }}{%- endif %}
{{- '<|end|>' }}
{%- set turns = messages %}
{%- set instructions = namespace(text='') %}
{%- if messages and messages[0].role in ('system', 'developer') %}
  {%- set instructions.text = messages[0].content %}
  {%- set turns = messages[1:] %}
{%- endif %}
{%- if instructions.text or tools %}
  {{- '<|start|>developer<|message|>' }}
  {%- if instructions.text %}{{- '# Instructions\n\n' + instructions.text }}{%- endif %}
  {%- if tools %}
    {{- '\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n' }}
    {%- for tool in tools %}
      {{- '// ' + (tool.function.description or '') + '\ntype ' + tool.function.name }}
      {{- ' = (_: ' + (tool.function.parameters | tojson) + ') => any;\n\n' }}
    {%- endfor %}
    {{- '} // namespace functions' }}
  {%- endif %}
  {{- '<|end|>' }}
{%- endif %}
{%- set called = namespace(name='') %}
{%- for message in turns %}
  {%- if message.role == 'user' %}
    {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
  {%- elif message.role == 'assistant' and message.tool_calls %}
    {%- if message.thinking %}
      {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}
    {%- endif %}
    {%- for tool_call in message.tool_calls %}
      {%- set called.name = tool_call.function.name %}
      {{- '<|start|>assistant<|channel|>commentary to=functions.' + called.name }}
      {{- ' <|constrain|>json<|message|>' + (tool_call.function.arguments | tojson) + '<|call|>' }}
    {%- endfor %}
  {%- elif message.role == 'assistant' %}
    {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}
  {%- elif message.role == 'tool' %}
    {{- '<|start|>functions.' + called.name + ' to=assistant<|channel|>commentary<|message|>' }}
    {{- message.content + '<|end|>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"""

_CORPUS_MODULES = [
    "argparse", "asyncio/base_events", "collections/__init__", "contextlib", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email/message", "enum", "fractions",
    "functools", "gettext", "heapq", "http/client", "inspect", "ipaddress", "json/decoder",
    "logging/__init__", "mailbox", "pathlib", "pickle", "random", "shutil", "smtplib",
    "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing",
    "unittest/case", "urllib/parse", "uuid", "zipfile",
]  # fmt: skip


def corpus_lines(max_bytes: int = 3_000_000) -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for module in _CORPUS_MODULES:
        path = stdlib / f"{module}.py"
        if not path.exists():
            path = stdlib / module / "__init__.py"
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.strip():
                total += len(line)
                yield line + "\n"
            if total >= max_bytes:
                return


@functools.cache
def _trained_json(vocab_size: int) -> str:
    return _train(vocab_size).to_str()


def train_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    """A fresh tokenizer object; training runs once per vocab size per process."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_json(vocab_size))


def _train(vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer

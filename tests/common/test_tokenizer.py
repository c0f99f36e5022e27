"""The torch-free tokenizer agrees with transformers, token for token."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.tokenizer import Tokenizer, TokenizerError

TEXTS = ["Hello, world!", "def f(x):\n    return x * 2  # ünïcödé ✓", "", "  spaces   here "]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_matches_transformers(model_factory, arch):
    from transformers import AutoTokenizer

    model_dir = model_factory(arch)
    ours, theirs = Tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    for generation_prompt in (True, False):
        expected = theirs.apply_chat_template(
            MESSAGES, add_generation_prompt=generation_prompt, tokenize=False
        )
        assert ours.render_chat(MESSAGES, generation_prompt) == expected
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.vocab_size == len(theirs)


def test_no_template_is_a_clear_error(tiny_llama, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_llama / name).read_bytes())
    tokenizer = Tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.apply_chat_template(MESSAGES)


def test_imports_without_torch(tiny_llama):
    code = (
        "import sys; from common.tokenizer import Tokenizer; "
        f"t = Tokenizer({str(tiny_llama)!r}); t.apply_chat_template([{{'role': 'user', "
        "'content': 'hi'}]); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

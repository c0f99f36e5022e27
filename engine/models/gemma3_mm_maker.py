"""The parts of a made Gemma 3 vision-language checkpoint (``make_model("gemma3_mm", ...)``,
``Gemma3ForConditionalGeneration``): Gemma 3's language model (``maker._gemma3_config``), a
small SigLIP tower, the three image tokens, a template written like Gemma 3's (content
parts, ``<start_of_image>`` for an image, text parts trimmed), and Gemma 3's
``preprocessor_config.json``.

The tokenizer has a token for runs of 2 to 4 newlines (Gemma's has them up to 31).

The tower is 2 layers of width 64 over 56 x 56 images in 7 x 7 patches (an 8 x 8 grid),
pooled 2 x 2 into 16 tokens per image (Gemma 3: 896 x 896 in 14 x 14, 64 x 64 pooled
4 x 4 into 256).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BOI_TOKEN, EOI_TOKEN, IMAGE_SOFT_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# The special tokens by the names Gemma 3's tokenizer (and processor) give them.
GEMMA3_IMAGE_TOKENS = {
    "boi_token": BOI_TOKEN, "eoi_token": EOI_TOKEN, "image_token": IMAGE_SOFT_TOKEN,
}  # fmt: skip
# Gemma's vocabulary has a token for each run of newlines: an image's sequence
# ("\n\n<start_of_image>...") merges with the newline before it into one.
NEWLINE_RUNS = ["\n\n", "\n\n\n", "\n\n\n\n"]
IMAGE_SIZE, PATCH_SIZE, TOKENS_PER_IMAGE = 56, 7, 16
# Gemma 3's turn markers over ChatML's special tokens (the made tokenizer has no Gemma
# ones); a content part list as Gemma 3's template reads it.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|im_start|>' + role + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>model\\n' }}{% endif %}"
)


def gemma3_mm_config(text_config: Any, token_ids: dict[str, int]) -> Any:
    """``Gemma3Config`` around ``text_config``; ``token_ids``: the image tokens' ids."""
    import transformers

    vision = transformers.SiglipVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, vision_use_head=False,
    )  # fmt: skip
    return transformers.Gemma3Config(
        text_config=text_config,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=token_ids[BOI_TOKEN],
        eoi_token_index=token_ids[EOI_TOKEN],
        image_token_index=token_ids[IMAGE_SOFT_TOKEN],
    )


def write_gemma3_files(out: Path) -> None:
    """Gemma 3's image processor and processor configs at the tower's size, as its
    checkpoints ship them, and its
    image tokens named in the tokenizer's config (transformers 5 saves them in a form it
    does not read back)."""
    path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(path.read_text())
    tokenizer_config["extra_special_tokens"] = GEMMA3_IMAGE_TOKENS
    path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    config = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_resize": True,
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": None,
        "do_pan_and_scan": None,
        "image_seq_length": TOKENS_PER_IMAGE,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
    processor = {"image_seq_length": TOKENS_PER_IMAGE, "processor_class": "Gemma3Processor"}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")

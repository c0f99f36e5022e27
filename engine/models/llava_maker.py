"""The parts of a made LLaVA-layout checkpoint (``make_model("llava", ...)``): a Llama
language model (the size's), a small CLIP vision tower, the image token, a ChatML template
that reads OpenAI-style content parts and writes ``<image>`` for each image, and CLIP's
``preprocessor_config.json``.

The tower is 3 layers of width 64 over 28 x 28 images in 7 x 7 patches, read at its second
to last layer with the class token dropped (LLaVA-1.5's choice): 16 tokens per image.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH_SIZE = 28, 7
# ChatML over content that is a string or a list of parts ({"type": "text" | "image"}).
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# CLIP's normalization (what LLaVA-1.5's processor uses).
_MEAN = [0.48145466, 0.4578275, 0.40821073]
_STD = [0.26862954, 0.26130258, 0.27577711]


def llava_config(text_config: Any, image_token_id: int) -> Any:
    import transformers

    vision = transformers.CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=64,
    )  # fmt: skip
    return transformers.LlavaConfig(
        vision_config=vision,
        text_config=text_config,
        image_token_id=image_token_id,
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )


def write_preprocessor_config(out: Path) -> None:
    """CLIP's image processor at the tower's size, as transformers writes it."""
    config = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_resize": True,
        "size": {"shortest_edge": IMAGE_SIZE},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": _MEAN,
        "image_std": _STD,
        "do_convert_rgb": True,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")

"""The parts of a made Qwen2.5-VL checkpoint (``make_model("qwen2_5_vl", ...)``,
``Qwen2_5_VLForConditionalGeneration``): Qwen2's language model (the size's) with 3-D
rotary sections, a small vision transformer, the vision tokens, Qwen2.5-VL's ChatML
template over content parts, and its ``preprocessor_config.json``.

The tower is 4 layers of width 64 (the second and fourth attend over the whole image, the
others within windows of 56 x 56 pixels: 2 x 2 merge groups), its 14 x 14 patches merged
2 x 2 into a row. Images are resized to multiples of 28 between 56 x 56 and 64 tokens'
worth of pixels (Qwen2.5-VL: up to 16384 tokens), so an image is 4 to 64 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD]
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 64
# ChatML over content parts, an image written as Qwen2.5-VL's template writes it.
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def qwen2_5_vl_config(text_config: Any, token_ids: dict[str, int]) -> Any:
    """``Qwen2_5_VLConfig`` around ``text_config`` (a ``Qwen2Config``), its rotary split
    3 ways (time, rows, columns: a quarter, and three eighths twice, as Qwen2.5-VL's)."""
    import transformers

    text = text_fields(text_config)
    half = text["head_dim"] // 2
    rope = dict(text.get("rope_parameters") or {"rope_type": "default", "rope_theta": 1e6})
    rope["mrope_section"] = [half // 4, half * 3 // 8, half * 3 // 8]
    text["rope_parameters"] = rope
    vision = {
        "depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
        "out_hidden_size": text["hidden_size"], "patch_size": 14, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1, 3],
    }  # fmt: skip
    return vl_config(transformers.Qwen2_5_VLConfig, text, vision, token_ids, tied=True)


def text_fields(text_config: Any) -> dict[str, Any]:
    """A language model's config as a Qwen vision-language config's ``text_config``:
    without its own class's keys (nor ``norm_topk_prob``: the Qwen VL MoE routers always
    renormalize, their configs have no such key)."""
    text = text_config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "norm_topk_prob"):
        text.pop(key, None)
    return text


def vl_config(
    config_class: Any,
    text: dict[str, Any],
    vision: dict[str, Any],
    token_ids: dict[str, int],
    tied: bool,
) -> Any:
    """A Qwen vision-language config of ``config_class`` with the made vision tokens;
    ``tied``: the embeddings tied unless ``text`` says."""
    return config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids[IMAGE_PAD],
        vision_start_token_id=token_ids[VISION_START],
        vision_end_token_id=token_ids[VISION_END],
        tie_word_embeddings=text.get("tie_word_embeddings", tied),
    )


def write_qwen2_5_vl_files(out: Path) -> None:
    """Qwen2.5-VL's image processor config, at the made model's pixel bounds."""
    write_processor_config(
        out, "Qwen2_5_VLProcessor", 14,
        mean=[0.48145466, 0.4578275, 0.40821073], std=[0.26862954, 0.26130258, 0.27577711],
        bounds={"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS},
    )  # fmt: skip


def write_processor_config(
    out: Path,
    processor_class: str,
    patch_size: int,
    mean: list[float],
    std: list[float],
    bounds: dict[str, Any],
) -> None:
    """A Qwen ``Qwen2VLImageProcessor`` config (2 x 2 merges, 2-frame temporal patches)
    with the made model's patch size, normalization and pixel ``bounds`` (transformers
    4's ``min_pixels`` / ``max_pixels`` or 5's ``size``)."""
    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor_class,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": mean,
        "image_std": std,
        "resample": 3,
        **bounds,
        "patch_size": patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")

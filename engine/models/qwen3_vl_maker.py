"""The parts of a made Qwen3-VL checkpoint (``make_model("qwen3_vl", ...)``,
``Qwen3VLForConditionalGeneration``): Qwen3's language model (the size's) with interleaved
3-D rotary sections, a small vision transformer with DeepStack, Qwen2.5-VL's vision tokens
and template (Qwen3-VL writes an image the same way), and its ``preprocessor_config.json``.

``qwen3_vl_moe`` (``Qwen3VLMoeForConditionalGeneration``) is the same around Qwen3-MoE's
language model, its experts 3/4 of the hidden width (no stacked expert tensor is square, so
their layout is unambiguous) and stored stacked in the released layout (input-major:
``write_released_expert_layout``).

``qwen3_5_mm`` (``Qwen3_5ForConditionalGeneration``) is Qwen3.5's: the same tower without
DeepStack before ``qwen3_5``'s hybrid language model, its partial rotary's frequency pairs
interleaved over the 3-D positions.

The tower is 4 layers of width 64 over 16 x 16 patches merged 2 x 2 into a row, with a
learned 8 x 8 position table (resized to every image's patch grid, smaller and larger);
the states after its layers 0, 2 and 3 go, merged, to the language model's first three
layers (DeepStack). Images are resized to multiples of 32 between 64 x 64 and 64 tokens'
worth of pixels (Qwen3-VL: 64 to 16384 tokens), so an image is 4 to 64 tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.models.qwen2_5_vl_maker import text_fields, vl_config, write_processor_config

MIN_PIXELS, MAX_PIXELS = 64 * 64, 32 * 32 * 64


# The made tower (Qwen3-VL's and Qwen3.5's shape, small).
_TOWER = {
    "depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "num_position_embeddings": 64,
}  # fmt: skip


def qwen3_vl_config(text_config: Any, token_ids: dict[str, int], arch: str) -> Any:
    """The vision-language config of ``arch`` around ``text_config``: ``qwen3_vl``'s
    ``Qwen3VLConfig`` (a ``Qwen3Config``; DeepStack after tower layers 0, 2 and 3),
    ``qwen3_vl_moe``'s ``Qwen3VLMoeConfig`` (a ``Qwen3MoeConfig``), or ``qwen3_5_mm``'s
    ``Qwen3_5Config`` (a ``Qwen3_5TextConfig``; no DeepStack). The rotary's frequency
    pairs are interleaved over time, rows and columns in the releases' proportions:
    Qwen3-VL's 24, 20, 20 of 64; Qwen3.5's 11, 11, 10 of 32 (a quarter of each head)."""
    import transformers

    text = text_fields(text_config)
    rope = dict(text.get("rope_parameters") or {"rope_type": "default", "rope_theta": 1e6})
    vision = {**_TOWER, "out_hidden_size": text["hidden_size"]}
    if arch == "qwen3_5_mm":
        pairs = int(text["head_dim"] * rope.get("partial_rotary_factor", 0.25)) // 2
        rows, columns = pairs * 11 // 32, pairs * 10 // 32
        config_class = transformers.Qwen3_5Config
    else:
        pairs = text["head_dim"] // 2
        rows = columns = pairs * 20 // 64
        vision["deepstack_visual_indexes"] = [0, 2, 3]
        config_class = transformers.Qwen3VLConfig
        if arch == "qwen3_vl_moe":
            text["moe_intermediate_size"] = text["hidden_size"] * 3 // 4
            config_class = transformers.Qwen3VLMoeConfig
    rope.update(mrope_section=[pairs - rows - columns, rows, columns], mrope_interleaved=True)
    text["rope_parameters"] = rope
    return vl_config(config_class, text, vision, token_ids, tied=False)


def write_qwen3_vl_files(out: Path) -> None:
    """Qwen3-VL's image processor config (transformers 5's ``size`` bounds), at the made
    model's pixel bounds."""
    bounds = {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}
    write_processor_config(out, "Qwen3VLProcessor", 16, [0.5] * 3, [0.5] * 3, bounds)


def write_released_expert_layout(out: Path) -> None:
    """Rewrite the saved stacked experts (transformers 5 saves them output-major) in the
    layout Qwen3-VL-MoE's releases store: ``gate_up_proj`` [E, H, 2I], ``down_proj``
    [E, I, H]."""
    from safetensors.torch import load_file, save_file

    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                tensors[name] = tensor.transpose(1, 2).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})

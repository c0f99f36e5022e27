"""A vision-language checkpoint's image side, read from its config.json (torch-free: the
router reads it to place images in prompts, the engine to build the encoder).

Served: LLaVA's layout (``LlavaForConditionalGeneration``: LLaVA-1.5 and the checkpoints
built like it): a CLIP or SigLIP vision transformer, the states of one or more of its
layers (``vision_feature_layer``) with the class token dropped or kept
(``vision_feature_select_strategy``), and a two-layer projector into the language model,
whose prompt holds one run of placeholder tokens per image.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

VISION_ARCHITECTURES = ("LlavaForConditionalGeneration",)
# The vision towers served, by their config's model_type: (class token, pre-norm) of each.
_TOWERS = {"clip_vision_model": (True, True), "siglip_vision_model": (False, False)}
# transformers' defaults for a config that leaves keys out (CLIPVisionConfig's, LlavaConfig's).
_TOWER_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "layer_norm_eps": 1e-5,
}
_GELU = ("gelu", "gelu_pytorch_tanh", "quick_gelu", "gelu_new")


class VisionConfigError(ValueError):
    """A vision-language config this build cannot serve; the message names the key."""


@dataclass(frozen=True, slots=True)
class VisionTowerSpec:
    kind: str  # "clip_vision_model" | "siglip_vision_model"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int  # pixels of a (square) image's side
    patch_size: int
    layer_norm_eps: float
    hidden_act: str  # "quick_gelu" (CLIP), "gelu_pytorch_tanh" (SigLIP), "gelu"

    @property
    def class_token(self) -> bool:
        return _TOWERS[self.kind][0]

    @property
    def pre_norm(self) -> bool:
        """CLIP norms the embeddings before the first layer (its ``pre_layrnorm``)."""
        return _TOWERS[self.kind][1]

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True, slots=True)
class VisionSpec:
    architecture: str
    tower: VisionTowerSpec
    image_token_id: int
    # Indexes into the tower's states: 0 the embeddings, i the output of layer i (negative
    # from the end); several are concatenated along the hidden size.
    feature_layers: tuple[int, ...]
    drop_class_token: bool  # vision_feature_select_strategy "default" (drops row 0)
    projector_act: str
    projector_bias: bool
    text_hidden_size: int

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (and encoder rows) per image."""
        return self.tower.num_patches + int(self.tower.class_token) - int(self.drop_class_token)


def read_vision_spec(raw: dict[str, Any], path: Path | str) -> VisionSpec | None:
    """The image side of a parsed config.json, or None for a text-only checkpoint. Raises
    ``VisionConfigError`` for a vision-language config outside what is served."""
    architectures = raw.get("architectures") or []
    architecture = next((a for a in architectures if a in VISION_ARCHITECTURES), None)
    if architecture is None and raw.get("model_type") == "llava":
        architecture = VISION_ARCHITECTURES[0]
    if architecture is None:
        return None
    vision = raw.get("vision_config") or {}
    kind = vision.get("model_type", "clip_vision_model")
    if kind not in _TOWERS:
        raise VisionConfigError(
            f"{path}: vision_config.model_type {kind!r} is not served "
            f"(served: {', '.join(_TOWERS)})"
        )
    values = {**_TOWER_DEFAULTS, **vision}
    default_act = "quick_gelu" if kind == "clip_vision_model" else "gelu_pytorch_tanh"
    act = values.get("hidden_act", default_act)
    projector_act = raw.get("projector_hidden_act", "gelu")
    for key, name in (("vision_config.hidden_act", act), ("projector_hidden_act", projector_act)):
        if name not in _GELU:
            raise VisionConfigError(f"{path}: {key} {name!r} is not served ({', '.join(_GELU)})")
    tower = VisionTowerSpec(
        kind=kind,
        hidden_size=int(values["hidden_size"]),
        intermediate_size=int(values["intermediate_size"]),
        num_layers=int(values["num_hidden_layers"]),
        num_heads=int(values["num_attention_heads"]),
        num_channels=int(values["num_channels"]),
        image_size=int(values["image_size"]),
        patch_size=int(values["patch_size"]),
        layer_norm_eps=float(values["layer_norm_eps"]),
        hidden_act=act,
    )
    layers = raw.get("vision_feature_layer", -2)
    layers = tuple(layers) if isinstance(layers, list) else (layers,)
    if not layers or any(not -tower.num_layers - 1 <= int(i) <= tower.num_layers for i in layers):
        raise VisionConfigError(
            f"{path}: vision_feature_layer {raw.get('vision_feature_layer')!r} names no state "
            f"of a {tower.num_layers}-layer tower"
        )
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise VisionConfigError(
            f"{path}: vision_feature_select_strategy {strategy!r} is not served (default, full)"
        )
    token_id = raw.get("image_token_id", raw.get("image_token_index"))
    if token_id is None:
        raise VisionConfigError(f"{path}: no image_token_id (or image_token_index)")
    text = raw.get("text_config") or {}
    text_hidden = text.get("hidden_size")
    if text_hidden is None:
        raise VisionConfigError(f"{path}: text_config.hidden_size is missing")
    return VisionSpec(
        architecture=architecture,
        tower=tower,
        image_token_id=int(token_id),
        feature_layers=tuple(int(i) for i in layers),
        drop_class_token=strategy == "default",
        projector_act=projector_act,
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        text_hidden_size=int(text_hidden),
    )

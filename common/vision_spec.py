"""A vision-language checkpoint's image side, read from its config.json (torch-free: the
router reads it to place images in prompts, the engine to build the encoder).

Served layouts:

- LLaVA's (``LlavaForConditionalGeneration``: LLaVA-1.5 and the checkpoints built like it):
  a CLIP or SigLIP vision transformer, the states of one or more of its layers
  (``vision_feature_layer``) with the class token dropped or kept
  (``vision_feature_select_strategy``), and a two-layer projector (``projector`` "mlp").
  A template's ``<image>`` becomes a run of placeholders; attention stays causal.
- Gemma 3's (``Gemma3ForConditionalGeneration``, 4B and up): a SigLIP tower read after its
  final norm, average-pooled to ``mm_tokens_per_image`` (256) rows, then RMSNorm and one
  matrix (``projector`` "pooled"). A template's ``<start_of_image>`` becomes
  ``"\n\n<start_of_image>" + placeholders + "<end_of_image>\n\n"`` in the text, and an
  image's tokens attend to each other both ways (``bidirectional``).
- Qwen2.5-VL's (``Qwen2_5_VLForConditionalGeneration``): its own vision transformer
  (``QwenTowerSpec``: 2-D rotary, windowed attention but in a few layers, 2 x 2 patch
  groups merged into one row), at dynamic resolution (``grid``: an image's token count
  follows from its size), and 3-D rotary positions in the language model (``mrope``:
  ``engine/mrope.py``). The template writes ``<|image_pad|>`` per image, which becomes as
  many of itself as the image has tokens.
- Qwen3-VL's (``Qwen3VLForConditionalGeneration``): Qwen2.5-VL's prompt layout and
  positions, another tower (``Qwen3TowerSpec``: learned position embeddings resized to the
  image's patch grid, full attention in every layer, 16-pixel patches), frequency pairs
  interleaved over the 3-D positions (``mrope_interleaved``), and DeepStack: the states of
  a few tower layers, merged as the output is, are added to the language model's first
  layers' outputs at the image's positions (``deepstack``). Qwen3-VL-MoE
  (``Qwen3VLMoeForConditionalGeneration``) is the same before a Qwen3-MoE language model,
  Qwen3.5 (``Qwen3_5ForConditionalGeneration``) without DeepStack before a hybrid one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.hf_config import text_config
from common.image_grid import DynamicGrid, read_dynamic_grid

LLAVA = "LlavaForConditionalGeneration"
GEMMA3 = "Gemma3ForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
QWEN3_VL = "Qwen3VLForConditionalGeneration"
QWEN3_VL_MOE = "Qwen3VLMoeForConditionalGeneration"  # Qwen3-VL's tower, a Qwen3-MoE
QWEN3_5 = "Qwen3_5ForConditionalGeneration"  # Qwen3-VL's tower without DeepStack, hybrid
QWEN3_5_MOE = "Qwen3_5MoeForConditionalGeneration"  # the same, hybrid mixture of experts
VISION_ARCHITECTURES = (LLAVA, GEMMA3, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, QWEN3_5, QWEN3_5_MOE)
_BY_MODEL_TYPE = {"llava": LLAVA, "gemma3": GEMMA3, "qwen2_5_vl": QWEN2_5_VL,
                  "qwen3_vl": QWEN3_VL, "qwen3_vl_moe": QWEN3_VL_MOE,
                  "qwen3_5": QWEN3_5, "qwen3_5_moe": QWEN3_5_MOE}  # fmt: skip
# The M-RoPE sections (frequency pairs of time, rows, columns) where a config names none.
MROPE_SECTIONS = {QWEN2_5_VL: (16, 24, 24), QWEN3_VL: (24, 20, 20),
                  QWEN3_VL_MOE: (24, 20, 20), QWEN3_5: (11, 11, 10),
                  QWEN3_5_MOE: (11, 11, 10)}  # fmt: skip
# The vision towers served, by their config's model_type: (class token, pre-norm) of each.
_TOWERS = {"clip_vision_model": (True, True), "siglip_vision_model": (False, False)}
# transformers' defaults for a config that leaves keys out (CLIPVisionConfig's and
# SiglipVisionConfig's).
_TOWER_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip_vision_model": {
        "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
        "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32,
        "layer_norm_eps": 1e-5, "hidden_act": "quick_gelu",
    },
    "siglip_vision_model": {
        "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
        "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
        "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
    },
}  # fmt: skip
_GELU = ("gelu", "gelu_pytorch_tanh", "quick_gelu", "gelu_new")

logger = logging.getLogger(__name__)
# Gemma3Config's defaults.
_GEMMA3_DEFAULTS = {"mm_tokens_per_image": 256, "boi_token_index": 255999,
                    "eoi_token_index": 256000, "image_token_index": 262144}  # fmt: skip


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


@dataclass(frozen=True, slots=True, kw_only=True)
class QwenTower:
    """What Qwen's vision transformers share (Qwen2.5-VL's ``QwenTowerSpec``, Qwen3-VL's
    ``Qwen3TowerSpec``): patches of a still image seen as a video of ``temporal_patch_size``
    frames, a 2-D rotary, and ``merge_size`` x ``merge_size`` patches merged into one row of
    the language model's width."""

    hidden_size: int
    intermediate_size: int
    num_layers: int  # "depth"
    num_heads: int
    out_hidden_size: int  # the language model's width
    patch_size: int
    temporal_patch_size: int  # an image is its patches twice over (a 2-frame video)
    merge_size: int  # spatial_merge_size: merge_size x merge_size patches make one row
    rope_theta: float
    num_channels: int = 3
    kind: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class QwenTowerSpec(QwenTower):
    """Qwen2.5-VL's vision transformer (``Qwen2_5_VLVisionConfig``)."""

    window_size: int  # pixels of a side of an attention window (windowed layers)
    full_attention_layers: tuple[int, ...]  # fullatt_block_indexes: the others are windowed
    kind: str = "qwen2_5_vl_vision"


@dataclass(frozen=True, slots=True, kw_only=True)
class Qwen3TowerSpec(QwenTower):
    """Qwen3-VL's vision transformer (``Qwen3VLVisionConfig``)."""

    # A square table of learned position embeddings, resized (bilinear) to each image's
    # patch grid.
    num_position_embeddings: int
    # deepstack_visual_indexes: the layers whose states also go, merged, to the language
    # model's first layers (the i-th listed to layer i's output).
    deepstack_layers: tuple[int, ...]
    hidden_act: str
    kind: str = "qwen3_vl_vision"


@dataclass(frozen=True, slots=True)
class VisionSpec:
    architecture: str
    tower: VisionTowerSpec | QwenTower
    image_token_id: int  # the placeholder: one per encoder row
    # Indexes into the tower's states: 0 the embeddings, i the output of layer i (negative
    # from the end); several are concatenated along the hidden size.
    feature_layers: tuple[int, ...]
    drop_class_token: bool  # vision_feature_select_strategy "default" (drops row 0)
    projector: str  # "mlp" (LLaVA: linear, act, linear) | "pooled" (Gemma 3)
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    # Placeholder tokens (and encoder rows) per image; 0 with ``grid`` (per image, by size).
    tokens_per_image: int
    # What a chat template (or a user) writes for an image, which becomes its run:
    # LLaVA's is the placeholder itself, Gemma 3's ``<start_of_image>``.
    marker_token_id: int
    end_token_id: int | None = None  # Gemma 3's ``<end_of_image>`` after the run
    post_norm: bool = False  # the tower's final norm applies to the state read (Gemma 3)
    # An image's tokens attend to all of that image's tokens, later ones too (Gemma 3);
    # everything else stays causal.
    bidirectional: bool = False
    grid: DynamicGrid | None = None  # dynamic resolution (Qwen2.5-VL)
    # The language model's rotary positions are 3-D (time, row, column) over images
    # (Qwen2.5-VL's M-RoPE; ``engine/mrope.py``).
    mrope: bool = False
    # M-RoPE's frequency pairs take time, row and column in turn (Qwen3-VL), rather than in
    # three contiguous sections (Qwen2.5-VL).
    mrope_interleaved: bool = False
    # DeepStack (Qwen3-VL): the encoder's rows are ``1 + deepstack`` slices of
    # ``text_hidden_size``, the input embedding, then one to add to each of the language
    # model's first ``deepstack`` layers' outputs at the image's positions.
    deepstack: int = 0

    @property
    def rows_width(self) -> int:
        """Width of the encoder's output rows (``deepstack``)."""
        return self.text_hidden_size * (1 + self.deepstack)

    def image_text(self, token_text: Callable[[int], str]) -> tuple[str, str, str]:
        """(marker, lead, tail): the text a template writes for an image, and what comes
        before and after the image's placeholders when each marker becomes its sequence
        (as transformers' processors write it). ``token_text``: a token id's text."""
        marker = token_text(self.marker_token_id)
        if self.end_token_id is None:
            return marker, "", ""
        return marker, f"\n\n{marker}", f"{token_text(self.end_token_id)}\n\n"

    def num_tokens(self, size: tuple[int, int]) -> int:
        """Placeholder tokens of an image of ``size`` (width, height). Raises
        ``ValueError`` for a size dynamic resolution refuses."""
        if self.grid is None:
            return self.tokens_per_image
        return self.grid.num_tokens(*size)


def vision_architecture(raw: dict[str, Any]) -> str | None:
    """The served vision-language architecture a parsed config.json names, or None."""
    architectures = raw.get("architectures") or []
    architecture = next((a for a in architectures if a in VISION_ARCHITECTURES), None)
    if architecture is None and not architectures:
        architecture = _BY_MODEL_TYPE.get(raw.get("model_type", ""))
    return architecture


def served_vision_spec(raw: dict[str, Any], path: Path | str) -> VisionSpec | None:
    """``read_vision_spec``, where an image side outside what is served leaves the
    checkpoint's language model served for text (logged; image parts are then refused):
    a Gemma 3 export without a usable tower served text before its images were, and a
    vision-language model still answers text while its images cannot be read."""
    try:
        return read_vision_spec(raw, path)
    except VisionConfigError as exc:
        logger.warning("%s; serving its language model for text only", exc)
        return None


def read_vision_spec(raw: dict[str, Any], path: Path | str) -> VisionSpec | None:
    """The image side of a parsed config.json, or None for a text-only checkpoint. Raises
    ``VisionConfigError`` for a vision-language config outside what is served."""
    architecture = vision_architecture(raw)
    if architecture is None:
        return None
    text_hidden = text_config(raw).get("hidden_size")  # transformers' defaults filled in
    if text_hidden is None:
        raise VisionConfigError(f"{path}: text_config.hidden_size is missing")
    # A config without a vision_config gets its class's default tower.
    default_tower = "siglip_vision_model" if architecture == GEMMA3 else "clip_vision_model"
    if architecture == QWEN2_5_VL:
        return _qwen2_5_vl(raw, int(text_hidden), path)
    if architecture in (QWEN3_VL, QWEN3_VL_MOE, QWEN3_5, QWEN3_5_MOE):
        return _qwen3_vl(raw, architecture, int(text_hidden), path)
    tower = _read_tower(raw.get("vision_config") or {"model_type": default_tower}, path)
    if architecture == GEMMA3:
        return _gemma3(raw, tower, int(text_hidden), path)
    return _llava(raw, tower, int(text_hidden), path)


def _read_tower(vision: dict[str, Any], path: Path | str) -> VisionTowerSpec:
    kind = vision.get("model_type", "clip_vision_model")
    if kind not in _TOWERS:
        raise VisionConfigError(
            f"{path}: vision_config.model_type {kind!r} is not served "
            f"(served: {', '.join(_TOWERS)})"
        )
    values = {**_TOWER_DEFAULTS[kind], **vision}
    act = values["hidden_act"]
    if act not in _GELU:
        raise VisionConfigError(
            f"{path}: vision_config.hidden_act {act!r} is not served ({', '.join(_GELU)})"
        )
    return VisionTowerSpec(
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


def _llava(raw: dict[str, Any], tower: VisionTowerSpec, text_hidden: int, path) -> VisionSpec:
    projector_act = raw.get("projector_hidden_act", "gelu")
    if projector_act not in _GELU:
        raise VisionConfigError(
            f"{path}: projector_hidden_act {projector_act!r} is not served ({', '.join(_GELU)})"
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
    drop_class_token = strategy == "default"
    return VisionSpec(
        architecture=LLAVA,
        tower=tower,
        image_token_id=int(token_id),
        feature_layers=tuple(int(i) for i in layers),
        drop_class_token=drop_class_token,
        projector="mlp",
        projector_act=projector_act,
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        text_hidden_size=text_hidden,
        tokens_per_image=tower.num_patches + int(tower.class_token) - int(drop_class_token),
        marker_token_id=int(token_id),
    )


def _gemma3(raw: dict[str, Any], tower: VisionTowerSpec, text_hidden: int, path) -> VisionSpec:
    if tower.kind != "siglip_vision_model":
        raise VisionConfigError(f"{path}: Gemma 3's vision tower must be SigLIP, not {tower.kind}")
    values = {**_GEMMA3_DEFAULTS, **raw}
    processor = Path(path).parent / "preprocessor_config.json"
    if processor.is_file() and json.loads(processor.read_text()).get("do_pan_and_scan"):
        raise VisionConfigError(f"{processor}: do_pan_and_scan (Gemma 3's crops) is not served")
    num_tokens = int(values["mm_tokens_per_image"])
    patches_per_side = tower.image_size // tower.patch_size
    tokens_per_side = round(num_tokens**0.5)
    if tokens_per_side**2 != num_tokens or patches_per_side % tokens_per_side:
        raise VisionConfigError(
            f"{path}: mm_tokens_per_image {num_tokens} does not pool a {patches_per_side} x "
            f"{patches_per_side} grid of patches into a square of whole cells"
        )
    return VisionSpec(
        architecture=GEMMA3,
        tower=tower,
        image_token_id=int(raw.get("image_token_id", values["image_token_index"])),
        feature_layers=(-1,),
        drop_class_token=False,
        projector="pooled",
        projector_act="",
        projector_bias=False,
        text_hidden_size=text_hidden,
        tokens_per_image=num_tokens,
        marker_token_id=int(raw.get("boi_token_id", values["boi_token_index"])),
        end_token_id=int(raw.get("eoi_token_id", values["eoi_token_index"])),
        post_norm=True,
        bidirectional=True,
    )


# Qwen2_5_VLVisionConfig's defaults where a config leaves keys out.
_QWEN_TOWER_DEFAULTS: dict[str, Any] = {
    "depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16,
    "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu",
}  # fmt: skip


def _qwen2_5_vl(raw: dict[str, Any], text_hidden: int, path) -> VisionSpec:
    vision = {**_QWEN_TOWER_DEFAULTS, **(raw.get("vision_config") or {})}
    if vision["hidden_act"] != "silu":
        raise VisionConfigError(
            f"{path}: vision_config.hidden_act {vision['hidden_act']!r} is not served (silu)"
        )
    tower = QwenTowerSpec(
        **_qwen_tower_fields(vision, text_hidden),
        window_size=int(vision["window_size"]),
        full_attention_layers=tuple(int(i) for i in vision["fullatt_block_indexes"]),
    )
    if tower.window_size % (tower.patch_size * tower.merge_size):
        raise VisionConfigError(
            f"{path}: vision_config.window_size {tower.window_size} is not a whole number of "
            f"{tower.patch_size * tower.merge_size}-pixel merged patches"
        )
    return _qwen_spec(raw, QWEN2_5_VL, tower, vision, text_hidden, path)


def _qwen_tower_fields(vision: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """The fields Qwen2.5-VL's and Qwen3-VL's tower specs share, from a ``vision_config``
    with its class's defaults filled in."""
    rope = vision.get("rope_parameters") or {}
    return {
        "hidden_size": int(vision["hidden_size"]),
        "intermediate_size": int(vision["intermediate_size"]),
        "num_layers": int(vision["depth"]),
        "num_heads": int(vision["num_heads"]),
        "out_hidden_size": int(vision.get("out_hidden_size", text_hidden)),
        "patch_size": int(vision["patch_size"]),
        "temporal_patch_size": int(vision["temporal_patch_size"]),
        "merge_size": int(vision["spatial_merge_size"]),
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "num_channels": int(vision["in_channels"]),
    }


def _qwen_spec(
    raw: dict[str, Any],
    architecture: str,
    tower: QwenTower,
    vision: dict[str, Any],
    text_hidden: int,
    path,
    **fields: Any,
) -> VisionSpec:
    """The spec of a Qwen vision-language checkpoint (dynamic resolution, M-RoPE), its
    image processor's grid checked against ``tower``; ``fields``: the layout's own."""
    grid = read_dynamic_grid(Path(path).parent, vision)
    if (grid.patch_size, grid.merge_size) != (tower.patch_size, tower.merge_size):
        raise VisionConfigError(
            f"{path}: the image processor's patch and merge sizes {grid.patch_size}, "
            f"{grid.merge_size} differ from the vision tower's"
        )
    token_id = int(raw.get("image_token_id", 151655))
    return VisionSpec(
        architecture=architecture,
        tower=tower,
        image_token_id=token_id,
        feature_layers=(-1,),
        drop_class_token=False,
        projector="merger",
        projector_act="gelu",
        projector_bias=True,
        text_hidden_size=text_hidden,
        tokens_per_image=0,
        marker_token_id=token_id,
        grid=grid,
        mrope=True,
        **fields,
    )


# Qwen3VLVisionConfig's defaults where a config leaves keys out.
_QWEN3_TOWER_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
    "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
    "hidden_act": "gelu_pytorch_tanh",
}  # fmt: skip


def _qwen3_vl(raw: dict[str, Any], architecture: str, text_hidden: int, path) -> VisionSpec:
    vision = {**_QWEN3_TOWER_DEFAULTS, **(raw.get("vision_config") or {})}
    if architecture in (QWEN3_5, QWEN3_5_MOE):  # Qwen3.5's tower has no DeepStack layers
        vision["deepstack_visual_indexes"] = []
    if vision["hidden_act"] not in _GELU:
        raise VisionConfigError(
            f"{path}: vision_config.hidden_act {vision['hidden_act']!r} is not served "
            f"({', '.join(_GELU)})"
        )
    tower = Qwen3TowerSpec(
        **_qwen_tower_fields(vision, text_hidden),
        num_position_embeddings=int(vision["num_position_embeddings"]),
        deepstack_layers=tuple(int(i) for i in vision["deepstack_visual_indexes"]),
        hidden_act=vision["hidden_act"],
    )
    side = round(tower.num_position_embeddings**0.5)
    if side * side != tower.num_position_embeddings:
        raise VisionConfigError(
            f"{path}: vision_config.num_position_embeddings {tower.num_position_embeddings} "
            "is not a square grid"
        )
    if any(not 0 <= i < tower.num_layers for i in tower.deepstack_layers):
        raise VisionConfigError(
            f"{path}: vision_config.deepstack_visual_indexes {list(tower.deepstack_layers)} "
            f"names no layer of a {tower.num_layers}-layer tower"
        )
    num_text_layers = text_config(raw).get("num_hidden_layers")
    if num_text_layers is not None and len(tower.deepstack_layers) > int(num_text_layers):
        raise VisionConfigError(
            f"{path}: {len(tower.deepstack_layers)} DeepStack layers for a "
            f"{num_text_layers}-layer language model"
        )
    return _qwen_spec(raw, architecture, tower, vision, text_hidden, path,
                      mrope_interleaved=True, deepstack=len(tower.deepstack_layers))  # fmt: skip

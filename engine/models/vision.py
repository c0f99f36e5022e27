"""A vision-language checkpoint's image encoder: a CLIP or SigLIP vision transformer, then a
projector into the language model's embedding space (``common/vision_spec.py``).

    pixels [n, 3, S, S] -> patches (a stride-P convolution) [n, (S/P)^2, C]
      (+ a class token in front, CLIP) + position embeddings (-> CLIP's pre-norm)
      -> pre-norm transformer layers, full (not causal) attention
      -> the states of ``feature_layers`` (class token dropped: "default"), concatenated
         (Gemma 3: the last layer's, through the tower's final norm)
      -> "mlp" (LLaVA): linear, GELU, linear
         "pooled" (Gemma 3): average pooling of the (S/P) x (S/P) grid into a square of
         tokens_per_image cells, RMSNorm (1 + w), one matrix
      -> [n, tokens_per_image, text_hidden]

Each image is encoded on its own, so its rows depend on its pixels alone: a row of the
prefix cache is the same whatever else a step holds. Its layers past the deepest feature
layer are never run (LLaVA-1.5 reads the second-to-last). The weights are replicated on
every rank that encodes (rank 0; ``engine/model_runner.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from common.vision_spec import Qwen3TowerSpec, QwenTower, VisionSpec, VisionTowerSpec
from engine.models.activations import activation
from engine.models.checkpoint_files import safetensors_files
from engine.models.empty_init import materialize
from engine.models.errors import ModelLoadError
from engine.models.norms import UnitOffsetRMSNorm
from engine.models.qwen3_vision import Qwen3VisionEncoder
from engine.models.qwen_vision import QwenVisionEncoder, rotary_inverse_frequencies

logger = logging.getLogger(__name__)

# Where checkpoints keep the tower and the projector: transformers 4's names (most files
# on the Hub), then 5's.
_TOWER_PREFIXES = ("vision_tower.vision_model.", "model.vision_tower.vision_model.",
                   "model.vision_tower.", "vision_tower.")  # fmt: skip
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
# Qwen2.5-VL's and Qwen3-VL's, transformers 4's then 5's.
_QWEN_PREFIXES = ("visual.", "model.visual.")
# Parts of a tower never read: SigLIP's pooling head, and the final norm unless the spec
# reads the last state through it (Gemma 3; LLaVA reads a layer's raw state).
_UNUSED = ("head.",)
_POST_NORM = "post_layernorm."


class VisionAttention(nn.Module):
    def __init__(self, spec: VisionTowerSpec) -> None:
        super().__init__()
        hidden = spec.hidden_size
        self.num_heads = spec.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, T, C] -> [n, T, C]
        n, length, hidden = x.shape
        heads = [
            proj(x).view(n, length, self.num_heads, -1).transpose(1, 2)  # [n, heads, T, d]
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        ]
        out = F.scaled_dot_product_attention(*heads)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, hidden))


class VisionLayer(nn.Module):
    def __init__(self, spec: VisionTowerSpec) -> None:
        super().__init__()
        self.act = spec.hidden_act
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = VisionAttention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.mlp.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(activation(self.act, self.mlp.fc1(self.layer_norm2(x))))


class VisionTower(nn.Module):
    def __init__(self, spec: VisionTowerSpec, num_layers: int, post_norm: bool = False) -> None:
        """``num_layers``: the layers run (the deepest feature layer). ``post_norm``: the
        last state goes through the tower's final norm."""
        super().__init__()
        self.spec = spec
        hidden = spec.hidden_size
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(
            spec.num_channels, hidden, spec.patch_size, spec.patch_size,
            bias=not spec.class_token,  # CLIP's has no bias, SigLIP's has
        )  # fmt: skip
        num_positions = spec.num_patches + int(spec.class_token)
        self.embeddings.position_embedding = nn.Embedding(num_positions, hidden)
        if spec.class_token:
            self.embeddings.class_embedding = nn.Parameter(torch.empty(hidden))
        if spec.pre_norm:
            self.pre_layrnorm = nn.LayerNorm(hidden, eps=spec.layer_norm_eps)  # CLIP's spelling
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionLayer(spec) for _ in range(num_layers))
        self.post_layernorm = nn.LayerNorm(hidden, eps=spec.layer_norm_eps) if post_norm else None

    def states(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """[n, 3, S, S] -> the embeddings, then each run layer's output: [n, T, C] each."""
        embeddings = self.embeddings
        patches = embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [n, P, C]
        if self.spec.class_token:
            cls = embeddings.class_embedding.expand(patches.shape[0], 1, -1)
            patches = torch.cat([cls, patches], dim=1)
        x = patches + embeddings.position_embedding.weight
        if self.spec.pre_norm:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        if self.post_layernorm is not None:
            states[-1] = self.post_layernorm(x)
        return states


class VisionEncoder(nn.Module):
    """Images to the language model's input rows for their placeholders."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        tower = spec.tower
        # Non-negative indexes into the states (0: embeddings, i: after layer i).
        self.feature_layers = tuple(i % (tower.num_layers + 1) for i in spec.feature_layers)
        self.vision_tower = VisionTower(tower, max(self.feature_layers), spec.post_norm)
        width = tower.hidden_size * len(self.feature_layers)
        text = spec.text_hidden_size
        projector = self.multi_modal_projector = nn.Module()
        if spec.projector == "pooled":
            projector.mm_soft_emb_norm = UnitOffsetRMSNorm(width, tower.layer_norm_eps)
            projector.mm_input_projection_weight = nn.Parameter(torch.empty(width, text))
        else:
            projector.linear_1 = nn.Linear(width, text, bias=spec.projector_bias)
            projector.linear_2 = nn.Linear(text, text, bias=spec.projector_bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] float32 -> [n, tokens_per_image, text_hidden] in the model dtype."""
        weight = self.vision_tower.embeddings.patch_embedding.weight
        states = self.vision_tower.states(pixels.to(weight.device, weight.dtype))
        start = int(self.spec.drop_class_token)
        features = torch.cat([states[i][:, start:] for i in self.feature_layers], dim=-1)
        projector = self.multi_modal_projector
        if self.spec.projector == "pooled":
            return self._pooled(features)
        hidden = activation(self.spec.projector_act, projector.linear_1(features))
        return projector.linear_2(hidden)

    def _pooled(self, features: torch.Tensor) -> torch.Tensor:
        """Gemma 3's projector: [n, P, C] patch states -> [n, tokens_per_image, text]."""
        n, num_patches, width = features.shape
        side = round(num_patches**0.5)
        cells = round(self.spec.tokens_per_image**0.5)
        grid = features.transpose(1, 2).reshape(n, width, side, side)  # row-major patches
        pooled = F.avg_pool2d(grid, side // cells).flatten(2).transpose(1, 2)  # [n, T, C]
        projector = self.multi_modal_projector
        return projector.mm_soft_emb_norm(pooled) @ projector.mm_input_projection_weight


# Any served encoder: a CLIP or SigLIP tower and a projector, or a Qwen tower.
AnyVisionEncoder = VisionEncoder | QwenVisionEncoder | Qwen3VisionEncoder


def _local_name(stored: str, spec: VisionSpec) -> str | None:
    """A stored tensor's parameter name in the spec's encoder; None: not the encoder's, or
    a part of it never read."""
    if isinstance(spec.tower, QwenTower):
        for prefix in _QWEN_PREFIXES:
            if stored.startswith(prefix):
                return "visual." + stored[len(prefix) :]
        return None
    for prefix in _PROJECTOR_PREFIXES:
        if stored.startswith(prefix):
            return "multi_modal_projector." + stored[len(prefix) :]
    for prefix in _TOWER_PREFIXES:
        if stored.startswith(prefix):
            rest = stored[len(prefix) :]
            if rest.startswith(_UNUSED) or (rest.startswith(_POST_NORM) and not spec.post_norm):
                return None
            return "vision_tower." + rest
    return None


def load_vision_encoder(
    model_dir: str | Path, spec: VisionSpec, device: torch.device, dtype: torch.dtype
) -> AnyVisionEncoder:
    """The encoder with the checkpoint's weights. Raises ``ModelLoadError`` for a missing,
    unexpected or misshapen tensor (layers past the deepest feature layer are skipped)."""
    tower = spec.tower
    qwen = isinstance(tower, QwenTower)
    with torch.device("meta"):
        if isinstance(tower, Qwen3TowerSpec):
            encoder = Qwen3VisionEncoder(spec)
        else:
            encoder = QwenVisionEncoder(spec) if qwen else VisionEncoder(spec)
    encoder = materialize(encoder, device, dtype)
    if qwen:  # a buffer, computed (materialize left it empty)
        encoder.inv_freq = rotary_inverse_frequencies(tower, device)
    params = dict(encoder.named_parameters())
    filled: set[str] = set()
    num_run = spec.tower.num_layers if qwen else len(encoder.vision_tower.encoder.layers)
    for path in safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = _local_name(stored, spec)
                if name is None or _past_run_layers(name, num_run):
                    continue
                param = params.get(name)
                if param is None:
                    raise ModelLoadError(f"{path}: unexpected vision tensor {stored}")
                tensor = f.get_tensor(stored)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ModelLoadError(
                        f"{path}: {stored} is {tuple(tensor.shape)}, the config says "
                        f"{tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(tensor)
                filled.add(name)
    missing = sorted(params.keys() - filled)
    if missing:
        raise ModelLoadError(f"{model_dir}: vision weights missing: {', '.join(missing[:5])}")
    logger.info(
        "vision encoder: %s, %d of %d layers run, %s tokens per image",
        spec.tower.kind, num_run, spec.tower.num_layers,
        spec.tokens_per_image or "by size",
    )  # fmt: skip
    return encoder.eval()


def _past_run_layers(name: str, num_run: int) -> bool:
    prefix = "vision_tower.encoder.layers."
    if not name.startswith(prefix):
        return False
    return int(name[len(prefix) :].split(".", 1)[0]) >= num_run

"""Qwen3-VL's vision encoder (``Qwen3TowerSpec``): images at their own resolution, cut in
16 x 16 patches, through a vision transformer that attends over the whole image in every
layer, then 2 x 2 patch groups merged into one row of the language model's width; and
DeepStack: the states after a few layers, merged the same way by their own mergers, as
extra rows for the language model's first layers.

    pixels [n, 3, H, W] (one size per call) ->
      patches in merge-group order [n, L, 3 * 2 * 16 * 16] (each patch twice: the
      temporal patch of a still image) -> linear patch embedding (with bias) [n, L, C]
      + learned position embeddings: a square table resized (bilinear, corners aligned)
        to the image's patch grid
      -> layers: LayerNorm, attention with the 2-D rotary (row, column of each patch) over
         the image, LayerNorm, MLP (tanh GELU); after each DeepStack layer, its state
         through its merger (LayerNorm over the 4 concatenated rows, linear, GELU, linear)
      -> merger: LayerNorm, 4 rows concatenated, linear, GELU, linear
      -> [n, L / 4, (1 + K) * text_hidden]: per placeholder token, its input embedding then
         the K DeepStack rows (``VisionSpec.deepstack``), raster order over the token grid

The result equals transformers' ``Qwen3VLModel.get_image_features`` (its ``pooler_output``
and ``deepstack_features``, pixels from ``Qwen2VLImageProcessor``).
"""

from __future__ import annotations

import torch
from torch import nn

from common.vision_spec import Qwen3TowerSpec, VisionSpec
from engine.models.activations import activation
from engine.models.qwen_vision import (
    apply_rotary,
    full_attention,
    merge_group_patches,
    merge_group_positions,
    patch_embedding,
    rotary_angles,
    rotary_inverse_frequencies,
)


class Qwen3VisionBlock(nn.Module):
    def __init__(self, tower: Qwen3TowerSpec) -> None:
        super().__init__()
        hidden = tower.hidden_size
        self.num_heads, self.act = tower.num_heads, tower.hidden_act
        self.norm1 = nn.LayerNorm(hidden, eps=1e-6)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn.proj = nn.Linear(hidden, hidden)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(hidden, tower.intermediate_size)
        self.mlp.linear_fc2 = nn.Linear(tower.intermediate_size, hidden)

    def forward(
        self,
        x: torch.Tensor,  # [n, L, C]
        cos: torch.Tensor,  # [L, head_dim] float32
        sin: torch.Tensor,
    ) -> torch.Tensor:
        n, length, _ = x.shape
        qkv = self.attn.qkv(self.norm1(x)).view(n, length, 3, self.num_heads, -1)
        query, key, value = qkv.unbind(2)  # [n, L, heads, head_dim]
        query, key = (apply_rotary(t, cos, sin) for t in (query, key))
        out = full_attention(query, key, value)  # each image over itself
        x = x + self.attn.proj(out.reshape(n, length, -1))
        mlp = self.mlp
        return x + mlp.linear_fc2(activation(self.act, mlp.linear_fc1(self.norm2(x))))


class Qwen3Merger(nn.Module):
    """2 x 2 patch rows -> one language-model row. The output's merger norms each patch
    row; a DeepStack merger (``post_shuffle``) norms the 4 concatenated."""

    def __init__(self, tower: Qwen3TowerSpec, post_shuffle: bool) -> None:
        super().__init__()
        merged = tower.hidden_size * tower.merge_size**2
        self.post_shuffle = post_shuffle
        self.norm = nn.LayerNorm(merged if post_shuffle else tower.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(merged, merged)
        self.linear_fc2 = nn.Linear(merged, tower.out_hidden_size)

    def forward(self, x: torch.Tensor, unit: int) -> torch.Tensor:
        """[n, L, C] -> [n, L / unit, out_hidden]."""
        n, length, width = x.shape
        if self.post_shuffle:
            x = self.norm(x.reshape(n, length // unit, unit * width))
        else:
            x = self.norm(x).reshape(n, length // unit, unit * width)
        return self.linear_fc2(nn.functional.gelu(self.linear_fc1(x)))


class Qwen3VisionEncoder(nn.Module):
    """Images to the language model's input rows (and DeepStack rows) for their
    placeholders."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        tower = spec.tower
        assert isinstance(tower, Qwen3TowerSpec)
        self.spec, self.tower = spec, tower
        hidden = tower.hidden_size
        self.visual = nn.Module()
        self.visual.patch_embed = patch_embedding(tower, bias=True)
        self.visual.pos_embed = nn.Embedding(tower.num_position_embeddings, hidden)
        self.visual.blocks = nn.ModuleList(Qwen3VisionBlock(tower) for _ in range(tower.num_layers))
        self.visual.merger = Qwen3Merger(tower, post_shuffle=False)
        self.visual.deepstack_merger_list = nn.ModuleList(
            Qwen3Merger(tower, post_shuffle=True) for _ in tower.deepstack_layers
        )
        self.register_buffer("inv_freq", rotary_inverse_frequencies(tower, None), persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] float32 (normalized; one size) -> [n, tokens, (1 + K) *
        text_hidden]. The rotary and the resized position table follow from the size
        alone: computed once a call."""
        tower, visual = self.tower, self.visual
        patch, merge = tower.patch_size, tower.merge_size
        rows, columns = pixels.shape[2] // patch, pixels.shape[3] // patch
        proj = visual.patch_embed.proj
        patches = torch.stack([merge_group_patches(image, tower) for image in pixels])
        patches = patches.to(proj.weight.device, proj.weight.dtype)  # [n, L, 3 * T * P * P]
        x = patches @ proj.weight.reshape(proj.weight.shape[0], -1).T + proj.bias  # [n, L, C]
        x = x + self._position_embeddings(rows, columns).to(x.dtype)
        angles = rotary_angles(self.inv_freq.to(x.device), rows, columns, merge)
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        unit = merge * merge
        deepstack: list[torch.Tensor] = []
        for index, block in enumerate(visual.blocks):
            x = block(x, cos, sin)
            if index in tower.deepstack_layers:
                merger = visual.deepstack_merger_list[tower.deepstack_layers.index(index)]
                deepstack.append(merger(x, unit))
        return torch.cat([visual.merger(x, unit), *deepstack], dim=-1)

    def _position_embeddings(self, rows: int, columns: int) -> torch.Tensor:
        """[rows * columns, C]: the learned side x side table resized to the patch grid
        (bilinear, corners aligned), in merge-group order; float32 weights, as
        transformers sums them."""
        table = self.visual.pos_embed.weight
        side = round(self.tower.num_position_embeddings**0.5)
        row_ids, column_ids = merge_group_positions(rows, columns, self.tower.merge_size,
                                                    table.device)  # fmt: skip
        row_taps, row_weights = _bilinear_taps(row_ids, rows, side)
        column_taps, column_weights = _bilinear_taps(column_ids, columns, side)
        indices = (row_taps[:, :, None] * side + column_taps[:, None, :]).reshape(-1, 4)
        weights = (row_weights[:, :, None] * column_weights[:, None, :]).reshape(-1, 4)
        return (table[indices] * weights[:, :, None]).sum(1)


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position on an axis of ``size``: the two source rows of a ``side``-long table
    it reads [N, 2] and their weights [N, 2] (corners aligned: 0 and size - 1 map to 0 and
    side - 1)."""
    source = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(source)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights

"""Qwen2.5-VL's vision encoder (``QwenTowerSpec``): images at their own resolution, cut in
14 x 14 patches, through a vision transformer whose attention sees a window of 8 x 8
patches in most layers and the whole image in a few, then 2 x 2 patch groups merged into
one row of the language model's width.

    pixels [n, 3, H, W] (one size per call) -> per image:
      patches in merge-group order [gh * gw, 3 * 2 * 14 * 14] (each patch twice: the
      temporal patch of a still image) -> linear patch embedding [gh * gw, C]
      -> reordered window by window (merge groups stay whole)
      -> layers: RMSNorm, attention with a 2-D rotary (row, column of each patch) inside a
         window or over the image, RMSNorm, SwiGLU
      -> merger: RMSNorm, 4 rows concatenated, linear, GELU, linear; back in raster order
      -> [gh * gw / 4, text_hidden]: one row per placeholder token, row-major over the
         image's token grid (``common/image_grid.py``)

The result equals transformers' ``Qwen2_5_VLModel.get_image_features`` (its pixels from
``Qwen2VLImageProcessor``); windows of one length are attended to together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.vision_spec import QwenTower, QwenTowerSpec, VisionSpec
from engine.models.norms import RMSNorm


class QwenVisionBlock(nn.Module):
    def __init__(self, tower: QwenTowerSpec) -> None:
        super().__init__()
        hidden = tower.hidden_size
        self.num_heads = tower.num_heads
        self.norm1 = RMSNorm(hidden, 1e-6)
        self.norm2 = RMSNorm(hidden, 1e-6)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn.proj = nn.Linear(hidden, hidden)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, tower.intermediate_size)
        self.mlp.up_proj = nn.Linear(hidden, tower.intermediate_size)
        self.mlp.down_proj = nn.Linear(tower.intermediate_size, hidden)

    def forward(
        self,
        x: torch.Tensor,  # [L, C]
        cos: torch.Tensor,  # [L, head_dim] float32
        sin: torch.Tensor,
        windows: list[torch.Tensor] | None,  # rows of each group of equal windows
    ) -> torch.Tensor:
        length = x.shape[0]
        qkv = self.attn.qkv(self.norm1(x)).view(length, 3, self.num_heads, -1)
        query, key, value = qkv.unbind(1)  # [L, heads, head_dim]
        query, key = (apply_rotary(t, cos, sin) for t in (query, key))
        if windows is None:  # the whole image
            out = full_attention(query[None], key[None], value[None])[0]
        else:
            out = torch.empty_like(query)
            for rows in windows:  # [num_windows, window_len] of one length
                out[rows] = full_attention(query[rows], key[rows], value[rows])
        x = x + self.attn.proj(out.reshape(length, -1))
        hidden = self.norm2(x)
        mlp = self.mlp
        return x + mlp.down_proj(F.silu(mlp.gate_proj(hidden)) * mlp.up_proj(hidden))


def rotary_inverse_frequencies(
    tower: QwenTower, device: torch.device | None
) -> torch.Tensor:  # [head_dim // 4]: a row's and a column's halves of each head
    head_dim = tower.hidden_size // tower.num_heads
    exponents = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
    inv_freq = 1.0 / (tower.rope_theta**exponents)
    return inv_freq if device is None else inv_freq.to(device)


def merge_group_positions(
    rows: int, columns: int, merge: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) [rows * columns] int64 of each patch of a ``rows`` x ``columns`` patch
    grid, in merge-group order: the ``merge`` x ``merge`` groups in raster order, each
    group's patches in raster order inside (the order the towers see patches in)."""
    shape = (rows // merge, merge, columns // merge, merge)
    row_ids = torch.arange(rows, device=device)[:, None].expand(rows, columns)
    column_ids = torch.arange(columns, device=device)[None, :].expand(rows, columns)
    row_ids = row_ids.reshape(shape).transpose(1, 2).flatten()
    column_ids = column_ids.reshape(shape).transpose(1, 2).flatten()
    return row_ids, column_ids


def rotary_angles(inv_freq: torch.Tensor, rows: int, columns: int, merge: int) -> torch.Tensor:
    """[rows * columns, head_dim // 2] float32: each patch's row angles then column angles,
    in merge-group order (the 2-D rotary; cos and sin of it twice over rotate a head)."""
    row_ids, column_ids = merge_group_positions(rows, columns, merge, inv_freq.device)
    return torch.cat((row_ids[:, None].float() * inv_freq,
                      column_ids[:, None].float() * inv_freq), dim=-1)  # fmt: skip


def merge_group_patches(pixels: torch.Tensor, tower: QwenTower) -> torch.Tensor:
    """[3, H, W] -> [H / P * W / P, 3 * T * P * P]: an image's patches in merge-group
    order, each repeated over the temporal patch (a still image is a video of T equal
    frames), as the Conv3d patch embedding reads them."""
    merge, patch = tower.merge_size, tower.patch_size
    channels, height, width = pixels.shape
    rows, columns = height // patch, width // patch
    # [C, gh/m, m, P, gw/m, m, P] -> [gh/m, gw/m, m, m, C, P, P]: merge groups whole.
    grouped = pixels.reshape(channels, rows // merge, merge, patch, columns // merge,
                             merge, patch).permute(1, 4, 2, 5, 0, 3, 6)  # fmt: skip
    patches = grouped[..., None, :, :].expand(*grouped.shape[:5], tower.temporal_patch_size,
                                              patch, patch)  # fmt: skip
    return patches.reshape(rows * columns, -1)


def patch_embedding(tower: QwenTower, bias: bool) -> nn.Module:
    """The tower's ``patch_embed``: transformers' Conv3d weight [C, 3, T, P, P] (and bias,
    Qwen3-VL's), held as parameters and applied as one linear map to
    ``merge_group_patches``' rows."""
    embed = nn.Module()
    embed.proj = nn.Module()
    embed.proj.weight = nn.Parameter(
        torch.empty(tower.hidden_size, tower.num_channels, tower.temporal_patch_size,
                    tower.patch_size, tower.patch_size)
    )  # fmt: skip
    if bias:
        embed.proj.bias = nn.Parameter(torch.empty(tower.hidden_size))
    return embed


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The 2-D rotary, in float32 as transformers applies it. [L, heads, d]."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def full_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """[B, L, heads, d] each -> [B, L, heads, d]: full attention within each of B."""
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, key, value)))
    return out.transpose(1, 2)


class QwenVisionEncoder(nn.Module):
    """Images to the language model's input rows for their placeholders."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        tower = spec.tower
        assert isinstance(tower, QwenTowerSpec)
        self.spec, self.tower = spec, tower
        hidden, merged = tower.hidden_size, tower.hidden_size * tower.merge_size**2
        self.visual = nn.Module()
        self.visual.patch_embed = patch_embedding(tower, bias=False)
        self.visual.blocks = nn.ModuleList(QwenVisionBlock(tower) for _ in range(tower.num_layers))
        self.visual.merger = nn.Module()
        self.visual.merger.ln_q = RMSNorm(hidden, 1e-6)
        self.visual.merger.mlp = nn.Sequential(
            nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, tower.out_hidden_size)
        )
        self.register_buffer("inv_freq", rotary_inverse_frequencies(tower, None), persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] float32 (normalized; one size) -> [n, tokens, text_hidden]. The
        window order and the rotary follow from the size alone: computed once a call."""
        merge, patch = self.tower.merge_size, self.tower.patch_size
        rows, columns = pixels.shape[2] // patch, pixels.shape[3] // patch
        device = self.visual.patch_embed.proj.weight.device
        order, windows = self._windows(rows // merge, columns // merge, device)
        cos, sin = self._rotary(rows, columns, order, device)
        return torch.stack([self._image(image, order, windows, cos, sin) for image in pixels])

    def _image(
        self,
        pixels: torch.Tensor,  # [3, H, W]
        order: torch.Tensor,  # ``_windows``'
        windows: list[torch.Tensor],
        cos: torch.Tensor,  # ``_rotary``'s
        sin: torch.Tensor,
    ) -> torch.Tensor:  # [T, text_hidden]
        tower, visual = self.tower, self.visual
        weight = visual.patch_embed.proj.weight
        patches = merge_group_patches(pixels, tower).to(weight.device, weight.dtype)
        x = patches @ weight.reshape(weight.shape[0], -1).T  # [L, C]
        unit = tower.merge_size**2
        x = x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)  # window by window
        for index, block in enumerate(visual.blocks):
            full = index in tower.full_attention_layers
            x = block(x, cos, sin, None if full else windows)
        merger = visual.merger
        merged = merger.mlp(merger.ln_q(x).view(-1, unit * x.shape[-1]))  # [T, text_hidden]
        return merged[torch.argsort(order)]

    def _rotary(
        self, rows: int, columns: int, order: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [L, head_dim] (float32) of each patch's (row, column), in the windows'
        order."""
        merge = self.tower.merge_size
        freqs = rotary_angles(self.inv_freq.to(device), rows, columns, merge)
        unit = merge * merge
        freqs = freqs.view(-1, unit, freqs.shape[-1])[order].reshape(freqs.shape)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _windows(
        self, grid_rows: int, grid_columns: int, device: torch.device
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The merge groups in window order (windows of ``window_size`` pixels, raster
        order, each raster inside), and the patch rows of each window after that
        reordering, grouped by window length: [num_windows, length] each."""
        side = self.tower.window_size // (self.tower.patch_size * self.tower.merge_size)
        unit = self.tower.merge_size**2
        index = torch.arange(grid_rows * grid_columns).view(grid_rows, grid_columns)
        order: list[torch.Tensor] = []
        lengths: list[int] = []
        for top in range(0, grid_rows, side):
            for left in range(0, grid_columns, side):
                window = index[top : top + side, left : left + side].flatten()
                order.append(window)
                lengths.append(window.numel() * unit)
        starts = torch.tensor([0, *lengths]).cumsum(0)[:-1].tolist()
        by_length: dict[int, list[torch.Tensor]] = {}
        for start, length in zip(starts, lengths, strict=True):
            by_length.setdefault(length, []).append(torch.arange(start, start + length))
        windows = [torch.stack(rows).to(device) for rows in by_length.values()]
        return torch.cat(order).to(device), windows

"""Quantize a made (float) checkpoint to GPTQ's or AWQ's packed integer layout, and write the
float checkpoint of exactly the weights it stands for: the test oracle (transformers reads
the float one; the engine must compute the same from the packed one). Round-to-nearest
per group, not GPTQ's or AWQ's calibrated search: the layouts are what is tested, and
released checkpoints cannot be downloaded here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.models.int_weights import AWQ_NIBBLE_OF_COLUMN
from engine.models.int_weights_config import SCHEMES, read_int_weights_config

# The projections quantized: every decoder layer's (and each expert's), not the routers.
_QUANTIZED = re.compile(r"^model\.layers\.\d+\..*(_proj|\.w[123])\.weight$")
_AWQ_COLUMN_OF_NIBBLE = [AWQ_NIBBLE_OF_COLUMN.index(n) for n in range(8)]


def quantize_int_checkpoint(
    model_dir: Path,
    out: Path,
    scheme: str,
    group_size: int = 32,
    seed: int = 0,
    dequantized_out: Path | None = None,
) -> Path:
    """``model_dir`` (one safetensors file) with its projections quantized by ``scheme``
    (``SCHEMES``) at ``out``; with ``dequantized_out``, also the float weights those
    stand for there (the same files otherwise). Returns ``out``."""
    quantization, symmetric = SCHEMES[scheme]
    method = quantization["quant_method"]
    if method == "compressed-tensors":  # its group size and act-order are per group
        act_order = quantization["config_groups"]["group_0"]["weights"]["actorder"] == "group"
    else:
        quantization = {**quantization, "group_size": group_size}
        act_order = bool(quantization.get("desc_act"))
    layouts = read_int_weights_config(quantization, scheme)  # what a reader makes of it
    assert layouts is not None
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(str(model_dir / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, weight in tensors.items():
        base = name.removesuffix(".weight")
        layout = layouts.for_module(base) if _QUANTIZED.match(name) else None
        if layout is None or weight.dim() != 2:  # (GPTQ's dynamic "-:" rules: not quantized)
            packed[name] = dequantized[name] = weight
            continue
        order = None
        if act_order:  # groups of rows in a random order
            order = torch.randperm(weight.shape[1], generator=generator)
        size = weight.shape[1] if layout.group_size == -1 else layout.group_size
        q, zeros, scales, g_idx = _quantize(weight.float(), layout.bits, size, symmetric, order)
        dequantized[name] = (q - zeros[g_idx].T).float() * scales[g_idx].T.float()
        packed.update(_stored(base, method, quantization, layout.bits, q, zeros, scales, g_idx,
                              symmetric, act_order))  # fmt: skip
    config = json.loads((model_dir / "config.json").read_text())
    outputs = [(out, packed, {"quantization_config": quantization})]
    if dequantized_out is not None:
        outputs.append((dequantized_out, dequantized, {}))
    for path, weights, extra in outputs:
        path.mkdir(parents=True)
        for file in model_dir.iterdir():
            if file.suffix != ".safetensors" and file.name != "config.json":
                (path / file.name).write_bytes(file.read_bytes())
        (path / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})  # fmt: skip
    return out


def _stored(
    base: str,
    method: str,
    quantization: dict,
    bits: int,
    q: torch.Tensor,  # [out, in] unsigned values
    zeros: torch.Tensor,  # [groups, out] unsigned
    scales: torch.Tensor,  # [groups, out] float16
    g_idx: torch.Tensor,  # [in]
    symmetric: bool,
    act_order: bool,
) -> dict[str, torch.Tensor]:
    """The tensors ``method`` stores for projection ``base``."""
    if method == "awq":
        return {base + ".qweight": _pack(q.T, 4, _AWQ_COLUMN_OF_NIBBLE),  # [in, out / 8]
                base + ".qzeros": _pack(zeros, 4, _AWQ_COLUMN_OF_NIBBLE),
                base + ".scales": scales}  # fmt: skip
    if method == "gptq":
        offset = int(quantization["checkpoint_format"] == "gptq")
        return {base + ".qweight": _pack(q, bits).T.contiguous(),  # [in / per_word, out]
                base + ".qzeros": _pack(zeros - offset, bits), base + ".scales": scales,
                base + ".g_idx": g_idx.to(torch.int32)}  # fmt: skip
    # compressed-tensors: unsigned values are its signed ones plus 2 ** (bits - 1)
    stored = {base + ".weight_packed": _pack(q, bits),  # [out, in / per_word]
              base + ".weight_scale": scales.T.contiguous(),  # [out, groups]
              base + ".weight_shape": torch.tensor(list(q.shape))}  # fmt: skip
    if not symmetric:
        stored[base + ".weight_zero_point"] = _pack(zeros, bits).T.contiguous()
    if act_order:
        stored[base + ".weight_g_idx"] = g_idx.to(torch.int32)
    return stored


def _quantize(
    weight: torch.Tensor,  # [out, in] float32
    bits: int,
    group_size: int,
    symmetric: bool,
    order: torch.Tensor | None,  # the input rows in quantization order (act-order)
) -> tuple[torch.Tensor, ...]:
    """(values [out, in] int64, zeros [groups, out] int64, scales [groups, out] float16,
    g_idx [in]): round-to-nearest per group of ``group_size`` input rows (taken in
    ``order``), the scales rounded to float16 before the values are."""
    num_out, num_in = weight.shape
    order = torch.arange(num_in) if order is None else order
    grouped = weight[:, order].reshape(num_out, num_in // group_size, group_size)
    top = (1 << bits) - 1
    if symmetric:
        scale = grouped.abs().amax(-1) * 2 / top
        zero = torch.full_like(scale, (top + 1) // 2)
    else:
        low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scale = (high - low) / top
        zero = torch.round(-low / scale.clamp(min=1e-8)).clamp(0, top)
    scale = scale.clamp(min=1e-8).half()
    values = torch.round(grouped / scale.float()[..., None]) + zero[..., None]
    values = values.clamp(0, top).reshape(num_out, num_in).long()
    g_idx = torch.empty(num_in, dtype=torch.int64)
    g_idx[order] = torch.arange(num_in) // group_size
    q = torch.empty_like(values)
    q[:, order] = values
    return q, zero.long().T.contiguous(), scale.T.contiguous(), g_idx


def _pack(values: torch.Tensor, bits: int, nibble_columns: list[int] | None = None) -> torch.Tensor:
    """[rows, n] small ints -> [rows, n * bits / 32] int32 words: each word's values from
    the lowest bits up, in column order or AWQ's (``nibble_columns[i]``: the column of
    each eight in nibble i)."""
    per_word = 32 // bits
    words = values.reshape(values.shape[0], -1, per_word) & ((1 << bits) - 1)
    if nibble_columns is not None:
        words = words[..., nibble_columns]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    packed = (words.long() << shifts).sum(-1)  # < 2 ** 32
    return ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)  # the same bits, as int32

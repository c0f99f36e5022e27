"""GPTQ's, AWQ's and compressed-tensors' packed integer weights dequantized to the model
dtype as they are read (``int_weights_config.py`` says which layouts load and how they
are packed).

Each value is unpacked, its zero subtracted and its scale applied in float32, then cast to
the model dtype once: the result is exactly the dequantized model, which is the tests'
oracle (transformers on a checkpoint of these float weights).
"""

from __future__ import annotations

import torch

from engine.models.errors import ModelLoadError
from engine.models.int_weights_config import IntWeights

# AWQ's packing puts column [0, 2, 4, 6, 1, 3, 5, 7][i] of each eight in nibble i, so
# column c is in nibble AWQ_NIBBLE_OF_COLUMN[c].
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] int32 -> [..., n, 32 / bits] int32: each word's values, lowest bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return (packed[..., None] >> shifts) & ((1 << bits) - 1)


def dequantize_int(
    layout: IntWeights,
    qweight: torch.Tensor,  # int32, packed as ``layout.method`` packs
    qzeros: torch.Tensor | None,  # int32 packed zeros; None: none stored (the zero: 2**(b-1))
    scales: torch.Tensor,  # [groups, out] float (compressed-tensors: [out, groups])
    g_idx: torch.Tensor | None,  # [in] int, GPTQ's group of each input row; None: contiguous
    dtype: torch.dtype,
    name: str,
    shape: tuple[int, int] | None = None,  # compressed-tensors' [out, in] (words may pad)
) -> torch.Tensor:  # [out, in] in dtype, as a float checkpoint stores X.weight
    """The weight ``qweight`` stands for, ``_ROWS_PER_PASS`` output rows at a time (so a
    pass's temporaries stay in cache: 2.2x faster than whole tensors on an 8B model's
    4096 x 14336 projection here). Shapes that do not fit each other raise
    ModelLoadError naming ``name``."""
    if qweight.dtype != torch.int32:
        raise ModelLoadError(f"{name}.qweight is stored as {qweight.dtype}, not int32")
    bits, method, per_word = layout.bits, layout.method, layout.per_word
    if method == "gptq":  # [in / per_word, out]
        num_in, num_out = qweight.shape[0] * per_word, qweight.shape[1]
    elif method == "awq":  # [in, out / 8]
        num_in, num_out = qweight.shape[0], qweight.shape[1] * per_word
    else:  # compressed-tensors: [out, ceil(in / per_word)], scales [out, groups]
        num_out, num_in = shape or (qweight.shape[0], qweight.shape[1] * per_word)
        if tuple(qweight.shape) != (num_out, -(-num_in // per_word)):
            raise ModelLoadError(f"{name}.weight_packed {tuple(qweight.shape)} does not hold "
                                 f"a {num_out} x {num_in} weight of {bits}-bit values")  # fmt: skip
        scales = scales.t()
    if qzeros is None:
        zeros = torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
    elif method == "compressed-tensors":  # [ceil(out / per_word), groups]
        zeros = unpack_words(qzeros.t(), bits).flatten(1)[:, :num_out]
    else:
        zeros = unpack_words(qzeros, bits)
        if method == "awq":
            zeros = zeros[..., list(AWQ_NIBBLE_OF_COLUMN)]
        zeros = zeros.flatten(1) + layout.zero_offset  # [groups, out]
    groups = 1 if layout.group_size == -1 else -(-num_in // layout.group_size)
    if tuple(scales.shape) != (groups, num_out) or tuple(zeros.shape) != (groups, num_out):
        raise ModelLoadError(
            f"{name}: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do not fit "
            f"a {num_in} x {num_out} weight in {groups} groups of {layout.group_size} "
            f"(expected {(groups, num_out)} each)"
        )
    if g_idx is not None and (
        tuple(g_idx.shape) != (num_in,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups
    ):
        raise ModelLoadError(f"{name}.g_idx {tuple(g_idx.shape)} does not name one of "
                             f"{groups} groups for each of {num_in} input rows")  # fmt: skip
    group_size = num_in if layout.group_size == -1 else layout.group_size
    contiguous = torch.arange(num_in, device=qweight.device) // group_size
    rows = None  # each input row's group, where groups are not runs of group_size rows
    if g_idx is not None and not torch.equal(g_idx.long(), contiguous):
        rows = g_idx.long()  # act-order
    elif num_in % group_size:
        rows = contiguous  # a last, partial group
    out = torch.empty(num_out, num_in, dtype=dtype, device=qweight.device)
    for start in range(0, num_out, _ROWS_PER_PASS):
        stop = min(start + _ROWS_PER_PASS, num_out)
        # Exact: values and zeros are small integers, so their float32 difference is too.
        weight = _unpacked_rows(layout, qweight, start, stop, num_in).to(torch.float32)
        zeros_t = zeros[:, start:stop].t().to(torch.float32)  # [rows, groups]
        scales_t = scales[:, start:stop].t().to(torch.float32)
        if rows is None:  # runs of group_size rows: broadcast, no gathered copies
            by_group = weight.view(stop - start, groups, group_size)
            by_group.sub_(zeros_t[..., None]).mul_(scales_t[..., None])
        else:
            weight.sub_(zeros_t[:, rows]).mul_(scales_t[:, rows])
        out[start:stop] = weight
    return out


# Output rows dequantized per pass: a pass's float32 rows of a 4096-wide input are 4 MiB.
_ROWS_PER_PASS = 256


def _unpacked_rows(
    layout: IntWeights, qweight: torch.Tensor, start: int, stop: int, num_in: int
) -> torch.Tensor:
    """Output rows ``start:stop`` of the packed values, [rows, in] int32 (``start`` and
    ``stop`` multiples of 8 for AWQ, whose words hold 8 output columns)."""
    if layout.method == "gptq":  # words run along the input: one pass
        return unpack_words(qweight[:, start:stop].t(), layout.bits).flatten(1)
    if layout.method == "compressed-tensors":  # the same, stored output-major and padded
        return unpack_words(qweight[start:stop], layout.bits).flatten(1)[:, :num_in]
    words = qweight[:, start // layout.per_word : -(-stop // layout.per_word)]  # [in, rows / 8]
    nibbles = unpack_words(words.t(), layout.bits)[..., list(AWQ_NIBBLE_OF_COLUMN)]
    return nibbles.permute(0, 2, 1).flatten(0, 1)  # [rows / 8, 8, in] -> [rows, in]

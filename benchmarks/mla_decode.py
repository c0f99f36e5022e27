"""The MLA decode kernel (``kernels/mla_decode.py``) beside the torch backend's absorbed
decode on the same paged latents: DeepSeek-V3's attention (128 heads, a 512 + 64 latent),
bf16, block size 16, for batch 1, 16, 64 at contexts 2k and 8k.

    python benchmarks/mla_decode.py [--json out.json] [--md out.md]

Per row: the kernel's device time (CUDA-graph replays, L2 flushed: ``kernels.bench``), its
achieved bandwidth (latent bytes read / time) against the device's HBM peak, the torch
path's eager time per call (it syncs on the host, so no graph) and the kernel's, and their
ratio. Needs CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import PEAK_BYTES_PER_S, bench, eager_ms
from kernels import reference
from kernels.mla_decode import mla_decode

NUM_HEADS, RANK, ROPE, BLOCK_SIZE = 128, 512, 64, 16
DTYPE = torch.bfloat16
SHAPES = [(b, c) for b in (1, 16, 64) for c in (2048, 8192)]


@dataclass
class Row:
    batch: int
    context: int
    kernel_ms: float  # graph replay
    kernel_eager_ms: float
    torch_eager_ms: float
    latent_bytes: int


def case(batch: int, context: int) -> Row:
    per_seq = triton.cdiv(context, BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    cache = torch.randn(num_blocks, 2, BLOCK_SIZE, 1, (RANK + ROPE) // 2, dtype=DTYPE,
                        device="cuda")  # fmt: skip
    order = torch.randperm(num_blocks - 1, device="cuda")[: batch * per_seq] + 1
    table = order.view(batch, per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, NUM_HEADS, RANK + ROPE, dtype=DTYPE, device="cuda")
    scale = 192**-0.5

    def kernel() -> torch.Tensor:
        return mla_decode(query, cache, seq_lens, table, scale, RANK, max_seq_len=context)

    def torch_path() -> torch.Tensor:
        return reference.decode_attention(query, cache, seq_lens, table, scale, latent_dim=RANK)

    torch.testing.assert_close(kernel().float(), torch_path().float(), atol=3e-2, rtol=3e-2)
    return Row(batch, context, bench(kernel), eager_ms(kernel), eager_ms(torch_path, calls=20),
               batch * context * (RANK + ROPE) * DTYPE.itemsize)  # fmt: skip


def table(rows: list[Row], peak: float) -> str:
    lines = ["| batch | context | kernel us | bandwidth | kernel eager us | torch eager us | "
             "torch / kernel |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        rate = r.latent_bytes / (r.kernel_ms * 1e-3)
        lines.append(f"| {r.batch} | {r.context} | {r.kernel_ms * 1e3:.1f} | {rate / 1e12:.2f} "
                     f"TB/s ({100 * rate / peak:.0f}%) | {r.kernel_eager_ms * 1e3:.1f} | "
                     f"{r.torch_eager_ms * 1e3:.1f} | "
                     f"{r.torch_eager_ms / r.kernel_eager_ms:.1f}x |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/mla_decode.py needs a CUDA device")
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BYTES_PER_S.items() if k in name), 3.35e12)
    header = (f"device: {name}; assumed peak {peak / 1e12:.2f} TB/s; torch {torch.__version__},"
              f" triton {triton.__version__}; {datetime.date.today().isoformat()}")  # fmt: skip
    print(header, flush=True)
    rows = []
    for batch, context in SHAPES:
        rows.append(case(batch, context))
        print(table(rows[-1:], peak).splitlines()[-1], flush=True)
    text = table(rows, peak)
    print(text)
    if args.md:
        args.md.write_text(f"{header}\n\n{text}\n")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "peak_bytes_per_s": peak,
                                         "rows": [asdict(r) for r in rows]}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

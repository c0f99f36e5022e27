"""Load a Llama-family model from a local Hugging Face directory (config.json + safetensors).

Handles one file (``model.safetensors``) or shards (``model.safetensors.index.json``), maps
the checkpoint's separate q/k/v and gate/up tensors into the fused projections, ties the
LM head to the embeddings when the config says so (unless the file stores a different
head, which transformers then uses untied), and fails with a message naming the
missing file or tensor.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention.backend import AttentionBackend
from engine.models.arch import ModelArchConfig, ModelLoadError
from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.)(self_attn|mlp)\.(q|k|v|gate|up)_proj\.(weight|bias)$")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{model_dir}: shards listed in the index are missing: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return others
    raise ModelLoadError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json "
        "(only safetensors checkpoints are loaded)"
    )


def _fused_target(name: str, arch: ModelArchConfig) -> tuple[str, int, int] | None:
    """For a separate q/k/v/gate/up tensor: (fused parameter name, row start, row count)."""
    match = _FUSED.match(name)
    if match is None:
        return None
    prefix, module, which, kind = match.groups()
    if module == "self_attn":
        starts = {"q": 0, "k": arch.q_size, "v": arch.q_size + arch.kv_size}
        sizes = {"q": arch.q_size, "k": arch.kv_size, "v": arch.kv_size}
        return f"{prefix}self_attn.qkv_proj.{kind}", starts[which], sizes[which]
    start = 0 if which == "gate" else arch.intermediate_size
    return f"{prefix}mlp.gate_up_proj.{kind}", start, arch.intermediate_size


def _stored_head_differs(files: list[Path]) -> bool:
    """Whether the checkpoint stores an ``lm_head.weight`` that is not the embeddings."""
    where: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in (_HEAD, _EMBED):
                if name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    where[name] = path
    if len(where) < 2:
        return False
    tensors = []
    for name in (_HEAD, _EMBED):
        with safe_open(str(where[name]), framework="pt", device="cpu") as f:
            tensors.append(f.get_tensor(name))
    return not torch.equal(tensors[0], tensors[1])


def load_model(
    model_dir: str | Path,
    arch: ModelArchConfig,
    max_positions: int,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    files = safetensors_files(model_dir)
    if arch.tie_word_embeddings and _stored_head_differs(files):
        # transformers (5) keeps such a head untied and uses it; so do we, for parity.
        logger.warning("%s: tie_word_embeddings is set but lm_head.weight differs from the "
                       "embeddings; using it untied, as transformers does", model_dir)  # fmt: skip
        arch = dataclasses.replace(arch, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions, backend)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.build_tables(device)
    params = dict(model.named_parameters())
    # Rows of each parameter filled so far, to detect missing tensors.
    rows_loaded: dict[str, int] = dict.fromkeys(params, 0)
    unexpected: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if _IGNORED.match(name) or (arch.tie_word_embeddings and name == _HEAD):
                    continue
                fused = _fused_target(name, arch)
                target, start = (fused[0], fused[1]) if fused else (name, 0)
                if target not in params:
                    unexpected.append(name)
                    continue
                tensor = f.get_tensor(name)
                param = params[target]
                rows = tensor.shape[0]
                if tuple(tensor.shape[1:]) != tuple(param.shape[1:]) or (
                    start + rows > param.shape[0]
                ):
                    raise ModelLoadError(
                        f"{path.name}: {name} has shape {tuple(tensor.shape)}, which does not "
                        f"fit {target} {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.data[start : start + rows].copy_(tensor.to(dtype))
                rows_loaded[target] += rows
    if unexpected:
        raise ModelLoadError(
            f"{model_dir}: unexpected tensors for {arch.architecture}: {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}"
        )
    missing = [name for name, rows in rows_loaded.items() if rows != params[name].shape[0]]
    if missing:
        raise ModelLoadError(
            f"{model_dir}: tensors missing from the checkpoint: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}"
        )
    model.eval()
    return model

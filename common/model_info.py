"""What the router needs to know about the served model, read without torch: where it is,
its context limit and its name. The built-in demo model's path is computed here too (its
files are made by ``engine.models.maker`` on first use)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import PdserveConfig, Role
from common.config_base import ConfigError
from common.hf_config import eos_token_ids, layer_types, max_context_len, text_config
from common.vision_spec import VisionSpec, served_vision_spec

DEMO_ARCH, DEMO_SIZE = "llama", "tiny"


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))


# Raised when made checkpoints change, so that cached ones are made again
# (``engine.models.maker.ensure_model``): 2 stored deepseek_v3's and glm4_moe's MTP layer.
MAKER_VERSION = 2
MADE_MODEL_INFO = "pdserve_model.json"


def made_model_dir(arch: str = DEMO_ARCH, size: str = DEMO_SIZE) -> Path:
    return cache_dir() / "models" / f"demo-{arch}-{size}"


def made_model_is_current(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a made model of this ``MAKER_VERSION``."""
    try:
        info = json.loads((model_dir / MADE_MODEL_INFO).read_text())
    except (OSError, ValueError):
        return False
    return (model_dir / "config.json").exists() and info.get("maker_version") == MAKER_VERSION


def model_dir_of(config: PdserveConfig) -> Path:
    """The checkpoint directory the config serves: ``model``, else the built-in demo."""
    return Path(config.model) if config.model else made_model_dir()


# The files of a LoRA adapter directory (PEFT's format; engine/models/lora.py reads them).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The modules ``pdserve make-lora`` can target (torch-free here for the CLI's parser).
# (the last five: a hybrid model's linear-attention layers, Qwen3.5's)
LORA_MAKER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                      "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                      "in_proj", "input_linear", "output_linear")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_dir: Path
    served_name: str
    max_model_len: int
    block_size: int
    vocab_size: int  # the model's (its embedding rows; may exceed the tokenizer's)
    model_type: str = ""  # config.json's (the text model's), e.g. "gpt_oss"
    # The ids the engine ends a sequence at (those inside the vocabulary, as the engine).
    eos_token_ids: frozenset[int] = frozenset()
    # A vision-language model's image side (``common/vision_spec.py``); None: text only.
    vision: VisionSpec | None = None
    # Linear-attention layers beside full attention (``common.hf_config.layer_types``).
    hybrid: bool = False
    # What a sentence-transformers checkpoint says it pools by, and the other modules it
    # runs after the transformer (``sentence_pooling``).
    pooling_modes: tuple[str, ...] = ()
    extra_modules: tuple[str, ...] = ()

    @property
    def foreign_pooling(self) -> str | None:
        """How the checkpoint's sentence-transformers pipeline makes an embedding, when
        the engine's (the last token's hidden state, normalized or not) is not it: its
        embeddings would not be the model's. None otherwise."""
        modes = self.pooling_modes
        if modes and modes != ("lasttoken",):
            return "pools by " + " and ".join(modes)
        if self.extra_modules:
            return "runs " + " and ".join(self.extra_modules) + " after pooling"
        return None


def model_info(config: PdserveConfig) -> ModelInfo:
    model_dir = model_dir_of(config)
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{model_dir} holds no checkpoint (config.json missing)")
    raw = json.loads(config_path.read_text())
    hf_config = text_config(raw)
    vision = served_vision_spec(raw, config_path)  # None where images cannot be served
    limit = max_context_len(hf_config)
    # The tightest limit of the roles that run (per-role engine overrides included): a
    # request must fit every worker it may be placed on.
    engines = [config.engine_for(role) for role in Role if config.role(role).replicas > 0]
    max_model_len = min([limit, *(e.max_model_len for e in engines if e.max_model_len)])
    check_text_parsers(config, hf_config)
    name = config.router.served_model_name or ("demo" if not config.model else model_dir.name)
    if name in config.lora.adapters:  # "model" would name both
        raise ConfigError(
            f"lora.adapters.{name}",
            "is also the served model's name; rename the adapter or set router.served_model_name",
        )
    vocab_size = int(hf_config.get("vocab_size", 0))
    eos = frozenset(i for i in eos_token_ids(hf_config, model_dir) if 0 <= i < vocab_size)
    pooling_modes, extra_modules = sentence_pooling(model_dir)
    return ModelInfo(model_dir, name, max_model_len, config.engine_for(Role.DECODE).block_size,
                     vocab_size, str(hf_config.get("model_type") or ""), eos, vision,
                     hybrid=layer_types(hf_config) is not None, pooling_modes=pooling_modes,
                     extra_modules=extra_modules)  # fmt: skip


# sentence-transformers modules the engine's embedding is (the rest change the vector).
_OWN_MODULES = ("Transformer", "Pooling", "Normalize")


def sentence_pooling(model_dir: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A sentence-transformers checkpoint's pooling modes (the ``config.json`` of the
    Pooling module ``modules.json`` lists: ``lasttoken``, ``mean_tokens``, ``cls_token``...)
    and its other modules (a ``Dense`` projection...); none when it names none (not such a
    checkpoint, or unreadable)."""
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
        kinds = [str(module.get("type", "")).rpartition(".")[2] for module in modules]
        extra = tuple(kind for kind in kinds if kind not in _OWN_MODULES)
        pooling = next(m for m in modules if str(m.get("type", "")).endswith(".Pooling"))
        config = json.loads((model_dir / str(pooling.get("path", "")) / "config.json").read_text())
        modes = tuple(key.removeprefix("pooling_mode_") for key, on in config.items()
                      if key.startswith("pooling_mode_") and on is True)  # fmt: skip
        return modes, extra
    except StopIteration:  # (no Pooling module)
        return (), extra
    except (OSError, ValueError, TypeError, AttributeError):
        return (), ()


def check_text_parsers(config: PdserveConfig, hf_config: dict[str, Any]) -> None:
    """GPT-OSS writes its replies in the Harmony format, which the router reads by itself
    (``router/harmony.py``): a text parser configured for it is a ``ConfigError``."""
    if hf_config.get("model_type") != "gpt_oss":
        return
    router = config.router
    for key, value in (("reasoning_parser", router.reasoning_parser),
                       ("tool_call_parser", router.tool_call_parser)):  # fmt: skip
        if value != "none":
            raise ConfigError(
                f"router.{key}",
                "GPT-OSS writes the Harmony format, which the router reads by itself "
                "(thinking, answer and tool calls): leave it none",
            )


def checkpoint_text_config(config: PdserveConfig) -> dict[str, Any] | None:
    """The served checkpoint's text-model config, None before it exists (a demo model
    made at first start)."""
    path = model_dir_of(config) / "config.json"
    return text_config(json.loads(path.read_text())) if path.exists() else None


# A bare backbone's names: the base model saved alone, without "model." (as
# Qwen3-Embedding-4B/8B's files are). The loader maps them under "model.".
BARE_NAMES = ("embed_tokens.", "layers.", "norm.")


def serves_embeddings_only(model_dir: Path) -> bool:
    """Whether the checkpoint is a backbone saved without its head (bare names, no
    ``lm_head.weight``), which the engine loads to serve embeddings only and to compute
    no logits (``engine/models/loader.py``). Reads tensor names only: the shard index, or
    each safetensors file's JSON header (no torch)."""
    names = _tensor_names(model_dir)
    bare = any(name.startswith(BARE_NAMES) for name in names)
    return bare and not any(name.endswith("lm_head.weight") for name in names)


def _tensor_names(model_dir: Path) -> list[str]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    names: list[str] = []
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:  # 8 bytes of header length, then the JSON header
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        names += [name for name in header if name != "__metadata__"]
    return names

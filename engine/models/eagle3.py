"""An EAGLE-3 head (``engine.speculative_method: eagle3``, ``engine.draft_model: DIR``):
one Llama decoder layer trained to draft for a target model from the target's own states.

At position ``q`` it reads three of the target's states there (the residual stream
entering layers ``aux_layer_ids``, by default 2, L/2 and L - 3), fused by ``fc``, and the
embedding of the token after it (``t_{q+1}``), and predicts ``t_{q+2}``:

    f_q = fc([a_q, b_q, c_q])               # [n, 3 * target hidden] -> [n, hidden]
    x = attn([input_layernorm(embed(t_{q+1})), hidden_norm(f_q)])   # q/k/v read 2 * hidden
    h'_q = f_q + x;  h'_q = h'_q + mlp(post_attention_layernorm(h'_q))
    draft = d2t(argmax lm_head(norm(h'_q)))   # in a draft vocabulary, mapped to the target's

So it drafts exactly as an MTP layer (``mtp.py``, ``engine/mtp_drafts.py``): one pass
after each step over the positions whose next token is now known, fed the target's
fused states (``features``); each further draft feeds it its own ``h'`` and its last
draft. Its KV is one more layer of the target's cache (same block ids, so it moves with
the prompt's blocks to a decode worker), which needs its KV heads and head size to be the
target's: true of the released heads (EAGLE's, and vLLM's speculators format).

Its drafts come from a smaller vocabulary (``draft_vocab_size``, the target's most
frequent tokens): ``d2t`` stores each draft id's offset to its target id. Checkpoints
without their own ``embed_tokens`` use the target's. ``norm_before_residual`` (a
speculators option) makes the normed ``f_q`` the residual.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from common.config_base import ConfigError
from common.hf_config import (
    EAGLE3_ARCHITECTURES,
    eagle3_aux_layer_ids,
    eagle3_kv_problem,
    eagle3_layer_config,
)
from common.tensor_parallel import split_problem
from engine.attention.backend import AttentionBackend
from engine.models.arch import ModelArchConfig, ModelLoadError, arch_from_config
from engine.models.checkpoint_files import safetensors_files
from engine.models.empty_init import materialize
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from engine.models.loader import copy_shard
from engine.models.norms import rms_norm
from engine.models.rope import RotaryEmbedding
from engine.parallel.group import SingleRank, TPGroup
from engine.parallel.shard_spec import TensorParallel, local_arch, shard_spec

_KEY = "engine.draft_model"


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    arch: ModelArchConfig  # the head's decoder layer, as a one-layer Llama
    draft_vocab_size: int
    target_hidden_size: int  # fc reads len(aux_layer_ids) of these
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool


def read_eagle3_config(head_dir: Path, target: ModelArchConfig, tp_size: int = 1) -> Eagle3Config:
    """The head's config, checked against ``target``'s and split over ``tp_size`` ranks.
    Raises ``ConfigError`` for a directory that holds no EAGLE-3 head, or one that
    cannot draft for ``target``."""
    path = head_dir / "config.json"
    if not path.is_file():
        raise ConfigError(_KEY, f"{head_dir} holds no config.json")
    raw = json.loads(path.read_text())
    layer = eagle3_layer_config(raw)
    if layer is None:
        raise ConfigError(
            _KEY,
            f"{path}: architectures {raw.get('architectures')} name no EAGLE-3 head "
            f"(speculative_method eagle3 reads {', '.join(EAGLE3_ARCHITECTURES)})",
        )
    if (raw.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise ConfigError(_KEY, f"{path}: use_aux_hidden_state false (an EAGLE-1 head)")
    try:
        arch = arch_from_config({**layer, "architectures": ["LlamaForCausalLM"]}, head_dir)
    except ModelLoadError as exc:
        raise ConfigError(_KEY, str(exc)) from None
    head_kv = (arch.num_kv_heads, arch.head_dim)
    problem = eagle3_kv_problem(head_dir, head_kv, (target.num_kv_heads, target.head_dim))
    if problem is not None:
        raise ConfigError(_KEY, problem)
    widths = {"intermediate_size": arch.intermediate_size}
    problem = split_problem(arch.num_q_heads, arch.num_kv_heads, widths, tp_size)
    if problem is not None:
        raise ConfigError(_KEY, f"{path}: tensor_parallel_size={tp_size}: {problem}")
    aux = eagle3_aux_layer_ids(raw, target.num_layers)
    if not all(0 <= i <= target.num_layers for i in aux):
        raise ConfigError(
            _KEY, f"{path}: eagle_aux_hidden_state_layer_ids {list(aux)} are not layers "
            f"0..{target.num_layers} of the target",
        )  # fmt: skip
    target_hidden = int(raw.get("target_hidden_size") or arch.hidden_size)
    if target_hidden != target.hidden_size:
        raise ConfigError(
            _KEY, f"{path}: the head reads states of width {target_hidden}, the target's "
            f"are {target.hidden_size}",
        )  # fmt: skip
    return Eagle3Config(
        arch=arch,
        draft_vocab_size=int(raw.get("draft_vocab_size") or arch.vocab_size),
        target_hidden_size=target_hidden,
        aux_layer_ids=aux,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
    )


class Eagle3Layer(DecoderLayer):
    """Llama's decoder layer whose attention reads ``[embeds, features]`` (2 * hidden).
    Under tensor parallelism (``arch``: the rank's heads and MLP slice) it is split as
    the target's layers are, so its KV heads are the rank's cache layer's."""

    def __init__(
        self,
        config: Eagle3Config,
        arch: ModelArchConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        group: TPGroup,
    ) -> None:
        super().__init__(arch, 0, rotary, backend, group)
        width = arch.q_size + 2 * arch.kv_size
        self.self_attn.qkv_proj = nn.Linear(2 * arch.hidden_size, width, bias=arch.qkv_bias)
        self.hidden_norm = rms_norm(arch, arch.hidden_size)
        self.norm_before_residual = config.norm_before_residual

    def predict(
        self,
        positions: torch.Tensor,  # [n]
        token_embeds: torch.Tensor,  # [n, hidden]: the tokens after each position
        features: torch.Tensor,  # [n, hidden]: fc of the target's states, or this layer's h'
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        attn_metadata: object,
    ) -> torch.Tensor:  # [n, hidden]: h', before the head's norm
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        both = torch.cat((self.input_layernorm(token_embeds), normed), dim=-1)
        reduce = self.group.all_reduce
        hidden = residual + reduce(self.self_attn(positions, both, kv_cache, attn_metadata))
        return hidden + reduce(self.mlp(self.post_attention_layernorm(hidden)))


class Eagle3Head(nn.Module):
    """The head's tensors, named as the checkpoint stores them (``midlayer`` is its layer;
    ``d2t`` becomes ``draft_to_target``, the target id of each draft id). Under tensor
    parallelism the layer is split (``Eagle3Layer``) and the rest replicated: every rank
    runs every pass, and rank 0 reads the drafts."""

    def __init__(
        self,
        config: Eagle3Config,
        target_vocab_size: int,
        max_positions: int,
        backend: AttentionBackend,
        own_embeddings: bool,
        group: TPGroup | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        arch = config.arch
        self.aux_layer_ids = config.aux_layer_ids
        self.target_vocab_size = target_vocab_size
        self.rotary = RotaryEmbedding(arch.rope, arch.rotary_dim, max_positions)
        local = local_arch(arch, tp or TensorParallel())
        self.midlayer = Eagle3Layer(config, local, self.rotary, backend, group or SingleRank())
        num_inputs = len(config.aux_layer_ids) * config.target_hidden_size
        self.fc = nn.Linear(num_inputs, arch.hidden_size, bias=False)
        self.norm = rms_norm(arch, arch.hidden_size)
        self.lm_head = nn.Linear(arch.hidden_size, config.draft_vocab_size, bias=False)
        # None: the target's embeddings (most released heads store none).
        self.embed_tokens = (
            nn.Embedding(arch.vocab_size, arch.hidden_size) if own_embeddings else None
        )
        self.register_buffer(
            "draft_to_target", torch.zeros(config.draft_vocab_size, dtype=torch.int64)
        )

    def features(self, hidden: torch.Tensor, aux_states: list[torch.Tensor]) -> torch.Tensor:
        """What its first pass after a step reads of the target ([n, hidden]): ``fc`` of
        the target's states at ``aux_layer_ids`` (each [n, H]; not ``hidden``, its last)."""
        return self.fc(torch.cat(aux_states, dim=-1))

    def carried(self, hidden: torch.Tensor) -> torch.Tensor:
        """What its next pass reads of this one's states: them, before its norm (EAGLE-3's
        recurrence, as vLLM's and SGLang's heads carry it)."""
        return hidden

    def draft_hidden(
        self,
        model: LlamaForCausalLM,
        input_ids: torch.Tensor,  # [n]: t_{q+1} for each position q
        positions: torch.Tensor,  # [n]: q
        previous_hidden: torch.Tensor,  # [n, hidden]: features, or the last pass's h'
        kv_cache: torch.Tensor,
        attn_metadata: object,
    ) -> torch.Tensor:  # [n, hidden]
        embed = model.model.embed_tokens if self.embed_tokens is None else self.embed_tokens
        return self.midlayer.predict(
            positions, embed(input_ids), previous_hidden, kv_cache, attn_metadata
        )

    def draft_logits(self, model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """[n, target vocab] float32: the draft vocabulary's logits at their target ids,
        -inf elsewhere, so their argmax is the head's draft. (Several draft ids of one
        target id keep their highest logit: released maps are one-to-one, but nothing in
        the format says so.)"""
        draft = self.lm_head(self.norm(hidden)).float()  # [n, draft vocab]
        logits = draft.new_full((draft.shape[0], self.target_vocab_size), float("-inf"))
        where = self.draft_to_target.expand(draft.shape[0], -1)
        return logits.scatter_reduce_(1, where, draft, reduce="amax")


def load_eagle3_head(
    head_dir: str | Path,
    target: ModelArchConfig,
    max_positions: int,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    group: TPGroup | None = None,
    tp: TensorParallel | None = None,
) -> Eagle3Head:
    """The head in ``head_dir`` (safetensors only: EAGLE's ``pytorch_model.bin`` is a
    pickle, which pdserve never loads; vLLM's speculators releases are safetensors), or
    rank ``tp.rank``'s part of it. Raises ``ConfigError`` for a head that cannot draft
    for ``target``."""
    head_dir = Path(head_dir)
    tp = tp or TensorParallel()
    config = read_eagle3_config(head_dir, target, tp.size)
    try:
        files = safetensors_files(head_dir)
    except ModelLoadError as exc:
        raise ConfigError(_KEY, str(exc)) from None
    stored: dict[str, tuple[Path, str]] = {}  # parameter name -> (file, stored name)
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                stored[_param_name(name)] = (path, name)
    own_embeddings = "embed_tokens.weight" in stored
    if not own_embeddings and config.arch.hidden_size != target.hidden_size:
        raise ConfigError(
            _KEY, f"{head_dir}: the head's width {config.arch.hidden_size} is not the "
            f"target's {target.hidden_size}, and it stores no embed_tokens of its own",
        )  # fmt: skip
    with torch.device("meta"):
        head = Eagle3Head(config, target.vocab_size, max_positions, backend, own_embeddings,
                          group, tp)  # fmt: skip
    head = materialize(head, device, dtype)
    head.rotary.build_tables(device)
    _fill(head, stored, head_dir, config.arch, tp)
    return head


def _param_name(stored: str) -> str:
    """A stored tensor's name in ``Eagle3Head``: EAGLE's ``midlayer.`` or speculators'
    ``layers.0.`` prefix, maybe under ``model.``."""
    name = stored.removeprefix("model.")
    if name.startswith("layers.0."):
        name = "midlayer." + name.removeprefix("layers.0.")
    return "draft_to_target" if name == "d2t" else name


# Fused parameters: (stored pieces in order, the parameter they fill).
_FUSED = (
    (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (("gate_proj", "up_proj"), "gate_up_proj"),
)


def _fill(
    head: Eagle3Head,
    stored: dict[str, tuple[Path, str]],
    head_dir: Path,
    arch: ModelArchConfig,  # the head's layer, whole
    tp: TensorParallel,
) -> None:
    """Copy every stored tensor (the rank's part of it) into its parameter; raise
    ``ModelLoadError`` naming a missing or misshapen one. ``t2d`` (the reverse map) is
    not needed; a head without ``d2t`` drafts in the target's own vocabulary."""
    params = dict(head.named_parameters())
    if "draft_to_target" in stored:
        params["draft_to_target"] = head.draft_to_target
    elif len(head.draft_to_target) == head.target_vocab_size:
        head.draft_to_target.copy_(torch.arange(head.target_vocab_size))
    else:
        raise ModelLoadError(f"{head_dir}: a draft vocabulary of {len(head.draft_to_target)} "
                             "ids needs its d2t map")  # fmt: skip
    filled: set[str] = set()

    def read(name: str) -> torch.Tensor:
        path, original = stored[name]
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(original)

    for param_name, param in params.items():
        parts = [param_name]
        for pieces, fused in _FUSED:
            for kind in ("weight", "bias"):
                if param_name.endswith(f"{fused}.{kind}"):
                    prefix = param_name.removesuffix(f"{fused}.{kind}")
                    parts = [f"{prefix}{piece}.{kind}" for piece in pieces]
        missing = [p for p in parts if p not in stored]
        if missing:
            raise ModelLoadError(f"{head_dir}: the EAGLE-3 head stores no {missing[0]}")
        tensor = torch.cat([read(p) for p in parts]) if len(parts) > 1 else read(parts[0])
        spec = None
        if param_name.startswith("midlayer."):  # cut as the target's layers are
            spec = shard_spec("model.layers.0." + param_name.removeprefix("midlayer."), arch, tp)
        full = spec.full_shape(tuple(param.shape)) if spec is not None else tuple(param.shape)
        if tuple(tensor.shape) != full:
            raise ModelLoadError(
                f"{head_dir}: {parts[0]} has shape {list(tensor.shape)}, the head's config "
                f"says {list(full)}"
            )
        if param_name == "draft_to_target":  # offsets -> the target ids themselves
            tensor = torch.arange(len(tensor)) + tensor.to(torch.int64)
            if tensor.min() < 0 or tensor.max() >= head.target_vocab_size:
                raise ConfigError(
                    _KEY, f"{head_dir}: d2t maps draft ids outside the target's vocabulary "
                    f"({head.target_vocab_size})",
                )  # fmt: skip
        with torch.no_grad():
            copy_shard(param.data, tensor, 0, spec, tp.rank)
        filled.update(parts)
    leftover = set(stored) - filled - {"t2d"}
    if leftover:
        raise ModelLoadError(
            f"{head_dir}: unexpected tensors in the EAGLE-3 head: {sorted(leftover)[:5]}"
        )

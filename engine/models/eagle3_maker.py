"""Make a random-weight EAGLE-3 head for a made (or any Llama-family) target, in EAGLE's
own release format (``LlamaForCausalLMEagle3``: ``midlayer.*``, ``fc``, ``norm``,
``lm_head``, ``d2t``/``t2d``), for tests and benchmarks; released heads cannot be
downloaded here. Its drafts are random: it proves the plumbing, not a speed-up."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# Keys of the target's config the head copies: its attention and rotary embedding.
_COPIED = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
           "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling",
           "rope_parameters", "vocab_size", "bos_token_id", "eos_token_id")  # fmt: skip


def make_eagle3_head(
    target_dir: Path,
    out: Path,
    draft_vocab_size: int,
    seed: int = 0,
    aux_layer_ids: tuple[int, ...] | None = None,
    own_embeddings: bool = False,
    norm_before_residual: bool = False,
    attention_bias: bool = False,
) -> Path:
    """Write the head to ``out`` and return it: one decoder layer of the target's
    attention shape, a draft vocabulary of ``draft_vocab_size`` target ids chosen at
    random (``d2t`` their offsets), ``aux_layer_ids`` stored when given (else the readers'
    default), the target's embeddings used unless ``own_embeddings``; q/k/v/o biases
    with ``attention_bias`` (Llama's key)."""
    target = json.loads((target_dir / "config.json").read_text())
    target = {**target, **target.get("text_config", {})}
    hidden, vocab = int(target["hidden_size"]), int(target["vocab_size"])
    num_heads = int(target["num_attention_heads"])
    num_kv_heads = int(target.get("num_key_value_heads") or num_heads)
    head_dim = int(target.get("head_dim") or hidden // num_heads)
    intermediate = 2 * hidden
    config = {k: target[k] for k in _COPIED if k in target}
    config.update(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
        intermediate_size=intermediate, draft_vocab_size=draft_vocab_size,
        hidden_act="silu", tie_word_embeddings=False, torch_dtype="float32",
        norm_before_residual=norm_before_residual, attention_bias=attention_bias,
    )  # fmt: skip
    if aux_layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    generator = torch.Generator().manual_seed(seed)
    std = 1.6 / hidden**0.5  # as the made models (maker.py)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std

    def gains() -> torch.Tensor:
        return 0.8 + 0.4 * torch.rand(hidden, generator=generator)

    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    tensors = {
        "midlayer.input_layernorm.weight": gains(),
        "midlayer.hidden_norm.weight": gains(),
        "midlayer.self_attn.q_proj.weight": normal(q_size, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": normal(kv_size, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": normal(kv_size, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": normal(hidden, q_size),
        "midlayer.post_attention_layernorm.weight": gains(),
        "midlayer.mlp.gate_proj.weight": normal(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": normal(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": normal(hidden, intermediate),
        "fc.weight": normal(hidden, 3 * hidden),
        "norm.weight": gains(),
        "lm_head.weight": normal(draft_vocab_size, hidden),
    }
    if attention_bias:
        for name, width in (("q", q_size), ("k", kv_size), ("v", kv_size), ("o", hidden)):
            tensors[f"midlayer.self_attn.{name}_proj.bias"] = normal(width)
    if own_embeddings:
        tensors["embed_tokens.weight"] = normal(vocab, hidden)
    draft_ids = torch.randperm(vocab, generator=generator)[:draft_vocab_size].sort().values
    tensors["d2t"] = draft_ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out

"""Checkpoint loading: configurations beyond the maker's, shards, and clear errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from common.hf_config import text_config
from engine import LLM, SamplingParams
from engine.models.arch import ModelLoadError, read_arch_config
from tests.engine.helpers import hf_greedy, random_prompts

SMALL = dict(
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.15,
)

VARIANTS = {
    "mistral-sliding-window": (transformers.MistralConfig, {"sliding_window": 24}),
    "llama-bias-linear-rope": (
        transformers.LlamaConfig,
        {
            "attention_bias": True,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        },
    ),
    "qwen3-mqa-head32": (
        transformers.Qwen3Config,
        {"num_key_value_heads": 1, "head_dim": 32},
    ),
    "qwen2-untied-sliding-upper-layers": (
        transformers.Qwen2Config,
        {
            "tie_word_embeddings": False,
            "use_sliding_window": True,
            "sliding_window": 20,
            "max_window_layers": 1,
        },
    ),
    "llama-tied-head128": (
        transformers.LlamaConfig,
        {"tie_word_embeddings": True, "num_attention_heads": 2, "head_dim": 128},
    ),
    # Mixture of experts: one expert per token, a sliding window on every layer.
    "mixtral-top1-sliding": (
        transformers.MixtralConfig,
        {"num_local_experts": 4, "num_experts_per_tok": 1, "sliding_window": 24},
    ),
    # A dense layer among the sparse ones, no q/k/v bias, 3 of 6 experts per token.
    "qwen2-moe-dense-layer-no-bias": (
        transformers.Qwen2MoeConfig,
        {
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 96,
            "mlp_only_layers": [0],
            "qkv_bias": False,
            "norm_topk_prob": True,
        },
    ),
    # Every second layer sparse (decoder_sparse_step), raw top-k weights, sliding window.
    "qwen3-moe-sparse-step-sliding": (
        transformers.Qwen3MoeConfig,
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 96,
            "decoder_sparse_step": 2,
            "norm_topk_prob": False,
            "use_sliding_window": True,
            "sliding_window": 20,
        },
    ),
}


def write_checkpoint(
    out: Path, tokenizer_from: Path, config_cls, dtype=torch.float32, shard=None, **overrides
) -> Path:
    config = config_cls(**{**SMALL, **overrides})
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_parity_on_architecture_variants(variant, tiny_llama, tmp_path):
    config_cls, overrides = VARIANTS[variant]
    model_dir = write_checkpoint(tmp_path, tiny_llama, config_cls, **overrides)
    prompts = random_prompts((5, 30, 50, 71))
    llm = LLM(model_dir, dtype="float32")
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 24)
    assert llm.engine.leak_report() == []


def test_sharded_bf16_checkpoint(tiny_llama, tmp_path):
    model_dir = write_checkpoint(
        tmp_path, tiny_llama, transformers.Qwen2Config, dtype=torch.bfloat16, shard="200KB"
    )
    assert (model_dir / "model.safetensors.index.json").exists()
    prompts = random_prompts((9, 64))
    llm = LLM(model_dir, dtype="float32")  # float32 compute from bf16 weights
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, min_tokens=16, temperature=0))
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 16)


def test_a_tensor_stored_in_two_shards_is_read_once(tiny_llama, tmp_path):
    """Counted twice, a tensor stored again in another shard filled its fused parameter
    (k, v and q rows in one) in place of a part missing from the files: with k_proj
    gone and v_proj stored twice, k's rows loaded as zeros, and with k_proj stored
    twice a complete checkpoint was refused."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tiny_llama / "model.safetensors"))
    k, v = (f"model.layers.1.self_attn.{p}_proj.weight" for p in "kv")

    def sharded(name: str, first: dict, second: dict) -> Path:
        out = tmp_path / name
        shutil.copytree(tiny_llama, out, ignore=shutil.ignore_patterns("*.safetensors"))
        weight_map = {}
        for number, part in enumerate((first, second), start=1):
            file = f"model-0000{number}-of-00002.safetensors"
            save_file(part, str(out / file), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(part, file)
        (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return out

    names = sorted(weights)
    first = {n: weights[n] for n in names[: len(names) // 2]}
    second = {n: weights[n] for n in names[len(names) // 2 :]}
    twice = sharded("k-twice", {**first, k: weights[k]}, {**second, k: weights[k]})
    prompts = random_prompts((9,))
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    expected = LLM(tiny_llama, dtype="float32").generate(prompts, params, use_tqdm=False)
    got = LLM(twice, dtype="float32").generate(prompts, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    without_k = {n: t for n, t in weights.items() if n != k}
    rest = [n for n in sorted(without_k) if n != v]
    halves = [{n: weights[n] for n in part} | {v: weights[v]}
              for part in (rest[: len(rest) // 2], rest[len(rest) // 2 :])]  # fmt: skip
    stale = sharded("v-twice", *halves)
    with pytest.raises(ModelLoadError, match="missing from the checkpoint.*layers.1.self_attn"):
        LLM(stale, dtype="float32")


def test_legacy_rope_scaling_keys_are_read(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_arch_config(tmp_path).rope == read_arch_config(tiny_llama).rope


def test_missing_and_unsupported_are_named(tiny_llama, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        LLM(broken)
    config = json.loads((tiny_llama / "config.json").read_text())
    for case, (key, value, message) in enumerate(
        (
            ("architectures", ["GPT2LMHeadModel"], "GPT2LMHeadModel.*not supported"),
            (
                "rope_parameters",
                {"rope_type": "longrope", "rope_theta": 1.0},
                "longrope.*not supported",
            ),
            ("rope_parameters", {"rope_type": "llama3", "factor": 8.0}, "needs low_freq_factor"),
            ("hidden_act", "gelu_pytorch_tanh", "hidden_act.*not supported"),
            (
                "quantization_config",
                {"quant_method": "hqq"},
                r"quantized.*\(hqq\)",
            ),
            ("quantization_config", {"quant_method": "awq"}, "awq group_size must be"),
            (  # AutoGPTQ's older key: refused by name, not as unexpected tensors
                "quantization_config",
                {"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True},
                "checkpoint_format 'marlin' is not supported",
            ),
        )
    ):
        odd = tmp_path / f"odd-{case}"
        shutil.copytree(tiny_llama, odd)
        (odd / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ModelLoadError, match=message):
            LLM(odd)
    fewer = tmp_path / "fewer-layers-in-weights"
    shutil.copytree(tiny_llama, fewer)
    (fewer / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    with pytest.raises(ModelLoadError, match=r"missing from the checkpoint.*layers\.4"):
        LLM(fewer)


def test_a_tensor_of_the_wrong_shape_is_named_with_the_shape_it_needs(tiny_llama, tmp_path):
    """Each stored tensor must have exactly the rows its part of a parameter takes. Only
    checked to fit, a q_proj 64 rows too long beside a k_proj 64 rows too short loaded
    (the fused qkv_proj's element count right, k's last rows never written: random
    weights served), and a short norm or embedding was reported missing, under the
    fused parameter's name, which the checkpoint does not have."""
    from safetensors.torch import load_file, save_file

    weights = load_file(tiny_llama / "model.safetensors")
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    norm = "model.layers.1.input_layernorm.weight"
    cases = (
        {q: torch.cat([weights[q], weights[k][:64]]), k: weights[k][64:]},
        {norm: weights[norm][:-1]},
        {"model.embed_tokens.weight": weights["model.embed_tokens.weight"][:-48]},
        {k: weights[k][:-1]},
    )  # fmt: skip
    for case, changes in enumerate(cases):
        odd = tmp_path / f"odd-{case}"
        shutil.copytree(tiny_llama, odd)
        save_file({**weights, **changes}, odd / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match="this config needs") as error:
            LLM(odd)
        # The first of the changed tensors read (q and k: either one) with its shape.
        assert any(f"{name} has shape {tuple(changes[name].shape)};" in str(error.value)
                   for name in changes), error.value  # fmt: skip


@pytest.mark.parametrize("model_type", ["llava", "gemma3", "qwen2_5_vl"])
def test_a_nested_configs_tie_is_read_as_transformers_reads_it(model_type):
    """Without a top-level key, LlavaConfig and Qwen2.5-VL's tie the head as their
    text_config says (a tied Qwen2-0.5B inside LLaVA stores no head: it was refused as
    missing lm_head.weight), Gemma3Config ties whatever its text_config says. (Where
    the two disagree, transformers' composite configs each have their own rule.)"""
    for top in (None, True, False):
        for nested in (None, True, False):
            if None not in (top, nested) and top != nested and model_type == "gemma3":
                continue
            inner = {} if nested is None else {"tie_word_embeddings": nested}
            outer = {} if top is None else {"tie_word_embeddings": top}
            theirs = transformers.AutoConfig.for_model(model_type, text_config=inner, **outer)
            ours = text_config({"model_type": model_type, **outer, "text_config": inner})
            assert ours["tie_word_embeddings"] == theirs.tie_word_embeddings, (top, nested)


def test_config_keys_left_out_take_transformers_defaults(tiny_llama, tmp_path):
    """config.json written with use_diff leaves out keys equal to transformers' defaults:
    Mistral's 4096-token window, Qwen's max_window_layers=28, llama3's original context
    (= max_position_embeddings); with no architectures, model_type names the class."""
    config = json.loads((tiny_llama / "config.json").read_text())
    config.pop("sliding_window", None)
    cases = {
        "mistral": ({**config, "architectures": ["MistralForCausalLM"]}, "sliding_windows",
                    (4096,) * config["num_hidden_layers"]),
        "qwen": ({**config, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                  "sliding_window": 64}, "sliding_windows", (None,) * config["num_hidden_layers"]),
        "no-architectures": ({**config, "architectures": None, "model_type": "qwen3"},
                             "architecture", "Qwen3ForCausalLM"),
        "llama3": ({**config, "max_position_embeddings": 777, "rope_parameters": {
                    "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0}}, "rope", None),
    }  # fmt: skip
    for name, (values, field, expected) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(values))
        arch = read_arch_config(tmp_path / name)
        if name == "llama3":
            assert arch.rope.original_max_position_embeddings == 777
        else:
            assert getattr(arch, field) == expected, name


def test_keys_read_as_each_architectures_transformers_config_reads_them(model_factory, tmp_path):
    """Qwen2-MoE's window before layer_types (every other layer below max_window_layers:
    Qwen2MoeConfig's rule, not Qwen2's), and GLM-4.5's partial rotary factor left out
    (0.5, Glm4MoeConfig's default: the whole head rotated here)."""
    for arch_name, edit in [
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 3,
                       "num_hidden_layers": 4}),
        ("glm4_moe", {}),
    ]:  # fmt: skip
        source = model_factory(arch_name)
        config = {**json.loads((source / "config.json").read_text()), **edit}
        for key in ("layer_types", "partial_rotary_factor"):
            config.pop(key, None)
        model_dir = tmp_path / arch_name
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config))
        arch = read_arch_config(model_dir)
        theirs = transformers.AutoConfig.from_pretrained(model_dir)
        if arch_name == "qwen2_moe":
            windows = tuple(6 if t == "sliding_attention" else None for t in theirs.layer_types)
            assert arch.sliding_windows == windows == (6, None, 6, None)
        else:
            assert theirs.rope_parameters["partial_rotary_factor"] == 0.5
            explicit = model_dir.with_name("glm-explicit")
            explicit.mkdir()
            (explicit / "config.json").write_text(
                json.dumps({**config, "partial_rotary_factor": 0.5})
            )
            assert arch.rope == read_arch_config(explicit).rope


@pytest.mark.parametrize("arch_name", ["qwen3", "qwen3_vl", "minimax_m2", "qwen3_next", "qwen3_5"])
def test_a_head_dim_left_out_is_transformers_default(model_factory, tmp_path, arch_name):
    """save_pretrained leaves out keys equal to their defaults: a Qwen3 whose heads are
    128 wide (its config class's default) has no head_dim, and hidden_size //
    num_attention_heads (Qwen3-0.6B's: 64) is not its width."""
    config = json.loads((model_factory(arch_name) / "config.json").read_text())
    config.pop("head_dim", None)
    config.get("text_config", {}).pop("head_dim", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    theirs = getattr(theirs, "text_config", theirs)
    assert text_config(config)["head_dim"] == theirs.head_dim
    assert theirs.head_dim != theirs.hidden_size // theirs.num_attention_heads
    if arch_name != "qwen3_vl":  # (its tiny model's image rotary needs its own width)
        assert read_arch_config(tmp_path).head_dim == theirs.head_dim


def test_a_llama_config_with_a_sliding_window_attends_as_transformers_llama(tiny_llama, tmp_path):
    """transformers' Llama (as vLLM's) has no window: the key, which a Mistral exported
    as Llama keeps, is ignored; every layer was windowed here, and the prompt's log-probs
    past the window were other than the model's. (transformers' ``generate`` does slide
    its cache by the key, while its forward pass does not: the forward is the oracle.)"""
    model_dir = write_checkpoint(tmp_path, tiny_llama, transformers.LlamaConfig,
                                 sliding_window=8)  # fmt: skip
    assert read_arch_config(model_dir).sliding_windows == (None, None)
    prompt = random_prompts((40,))[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    (output,) = LLM(model_dir, dtype="float32").generate([prompt], params, use_tqdm=False)
    for position, lp in enumerate(output.prompt_logprobs[1:]):
        assert lp.logprob == pytest.approx(reference[position][lp.token_id].item(), abs=1e-4)


def test_a_tied_config_with_a_different_stored_head_uses_it_as_transformers_does(
    tiny_llama, tmp_path
):
    from safetensors.torch import load_file, save_file

    model_dir = write_checkpoint(
        tmp_path, tiny_llama, transformers.LlamaConfig, tie_word_embeddings=True
    )
    weights = load_file(model_dir / "model.safetensors")
    torch.manual_seed(2)
    weights["lm_head.weight"] = torch.randn_like(weights["model.embed_tokens.weight"]) * 0.2
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    prompts = random_prompts((5, 40))
    llm = LLM(model_dir, dtype="float32")
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, min_tokens=12, temperature=0))
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 12)


def _stacked_layout(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral's per-expert tensors in transformers 5's stacked layout and names
    (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I])."""
    stacked: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in weights.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        match = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$", name)
        if match is None:
            stacked[name] = tensor
            continue
        prefix, expert, which = match.groups()
        per_expert.setdefault((prefix, which), {})[int(expert)] = tensor
    for prefix in {prefix for prefix, _ in per_expert}:
        experts = range(len(per_expert[(prefix, "w1")]))
        stacked[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([per_expert[(prefix, "w1")][e], per_expert[(prefix, "w3")][e]])
             for e in experts]
        )  # fmt: skip
        downs = [per_expert[(prefix, "w2")][e] for e in experts]
        stacked[f"{prefix}.down_proj"] = torch.stack(downs)
    return stacked


def test_stacked_expert_layout_loads_as_per_expert_tensors(model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    source = model_factory("mixtral")
    stacked = tmp_path / "stacked"
    shutil.copytree(source, stacked)
    weights = _stacked_layout(load_file(source / "model.safetensors"))
    assert not any("block_sparse_moe" in name for name in weights)
    save_file(weights, stacked / "model.safetensors", metadata={"format": "pt"})
    prompts = random_prompts((7, 45))
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    expected = hf_greedy(source, prompts, 12)
    for model_dir in (source, stacked):
        llm = LLM(model_dir, dtype="float32")
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, model_dir.name
        assert llm.engine.leak_report() == []


def test_mixture_of_experts_mismatches_are_named(model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    source = model_factory("qwen3_moe")
    config = json.loads((source / "config.json").read_text())
    experts_key = "num_experts" if "num_experts" in config else "num_local_experts"
    num_experts = config[experts_key]
    for case, (changes, message) in enumerate(
        (
            ({experts_key: None}, "no 'num_experts'"),
            ({"num_experts_per_tok": num_experts + 1}, "num_experts_per_tok"),
            ({experts_key: num_experts - 1}, f"names expert {num_experts - 1} of"),
            ({"moe_intermediate_size": config["moe_intermediate_size"] * 2}, "this config needs"),
        )
    ):
        odd = tmp_path / f"odd-{case}"
        shutil.copytree(source, odd)
        values = {k: v for k, v in {**config, **changes}.items() if v is not None}
        (odd / "config.json").write_text(json.dumps(values))
        with pytest.raises(ModelLoadError, match=message):
            LLM(odd)
    missing = tmp_path / "missing-expert"
    shutil.copytree(source, missing)
    weights = load_file(source / "model.safetensors")
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing.*layers\.2\.mlp\.experts\.gate_up_proj"):
        LLM(missing)


def test_eos_ids_outside_the_vocabulary_are_ignored(tiny_llama, tmp_path):
    """A generation_config naming an id past the vocabulary: it can never be sampled, so it
    ends nothing; banned before min_tokens it would have indexed past the logits."""
    shutil.copytree(tiny_llama, tmp_path, dirs_exist_ok=True)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    vocab = read_arch_config(tiny_llama).vocab_size
    generation["eos_token_id"] = [*generation["eos_token_id"], vocab + 5]
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    llm = LLM(tmp_path, dtype="float32")
    assert vocab + 5 not in llm.engine.eos_token_ids and llm.engine.eos_token_ids
    params = SamplingParams(max_tokens=8, min_tokens=4, temperature=1.0, seed=1)
    (output,) = llm.generate(random_prompts((12,)), params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) >= 4
    assert llm.engine.leak_report() == []

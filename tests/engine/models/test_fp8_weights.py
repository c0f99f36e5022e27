"""FP8 weight checkpoints (fp8, compressed-tensors, fbgemm_fp8, ModelOpt): the engine's
greedy tokens and prompt log-probs equal transformers' on the same files (transformers
dequantizes them on a CPU, as the engine does), the scales are applied per tensor, row,
expert and (partial) block, the calibrated KV-cache scales are read under each name, and
what does not load is refused by name."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from engine import LLM, SamplingParams
from engine.attention.torch_backend import TorchAttentionBackend
from engine.models.arch import ModelLoadError, read_arch_config
from engine.models.fp8_config import Fp8Weights, read_fp8_config
from engine.models.fp8_maker import FP8_MAX, quantize_checkpoint, quantize_weight
from engine.models.fp8_weights import dequantize_fp8
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model
from tests.engine.helpers import random_prompts

NUM_TOKENS = 16
BLOCK = (32, 64)  # transformers' CPU dequantizer needs blocks that divide the weights


def _expected(weight: torch.Tensor, scale_of) -> torch.Tensor:
    """Element by element: weight[r, c] * scale_of(r, c) (the oracle of the dequantizer)."""
    out = torch.empty(weight.shape)
    for r in range(weight.shape[0]):
        for c in range(weight.shape[1]):
            out[r, c] = weight[r, c].float() * scale_of(r, c)
    return out


def test_dequantize_per_tensor_row_and_partial_block():
    torch.manual_seed(0)
    weight = (torch.randn(5, 7) * 100).to(torch.float8_e4m3fn)  # 5 x 7: partial 2 x 3 blocks
    blocks = torch.rand(3, 3) + 0.5  # ceil(5/2) x ceil(7/3)
    got = dequantize_fp8(weight, blocks, (2, 3), torch.float32, "w")
    assert torch.equal(got, _expected(weight, lambda r, c: blocks[r // 2, c // 3]))
    rows = torch.rand(5, 1)
    for scale in (rows, rows.flatten()):  # [rows, 1] (compressed-tensors) and [rows]
        got = dequantize_fp8(weight, scale, None, torch.float32, "w")
        assert torch.equal(got, _expected(weight, lambda r, c: rows[r, 0]))
    one = torch.tensor([0.25])
    assert torch.equal(dequantize_fp8(weight, one, (2, 3), torch.float32, "w"),
                       weight.float() * 0.25)  # fmt: skip
    # Stacked experts [E, rows, cols] with a block grid per expert; and bf16 scales and
    # output: computed in float32, then cast once.
    experts = torch.stack([weight, (weight.float() / 2).to(torch.float8_e4m3fn)])
    grid = torch.stack([blocks, blocks * 3]).bfloat16()
    got = dequantize_fp8(experts, grid, (2, 3), torch.bfloat16, "w")
    for e in range(2):
        scale = grid[e].float()
        expected = _expected(experts[e], lambda r, c, s=scale: s[r // 2, c // 3])
        assert torch.equal(got[e], expected.bfloat16())
    per_expert = torch.tensor([0.5, 3.0])
    for scale in (per_expert, per_expert.reshape(2, 1, 1)):  # [E] and [E, 1, 1]
        scaled = dequantize_fp8(experts, scale, (2, 3), torch.float32, "w")
        assert torch.equal(scaled, experts.float() * per_expert.reshape(2, 1, 1))
    # Blocks that divide the weight take another path (a view, no expanded scales).
    even = dequantize_fp8(experts[:, :4, :6], grid[:, :2, :2], (2, 3), torch.bfloat16, "w")
    assert torch.equal(even, got[:, :4, :6])


def test_scales_that_fit_no_layout_are_refused_by_name():
    weight = torch.zeros(6, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ModelLoadError, match=r"q_proj\.weight: scales of shape \(2, 2\)"):
        dequantize_fp8(weight, torch.ones(2, 2), (4, 3), torch.float32, "layers.0.q_proj.weight")
    with pytest.raises(ModelLoadError, match=r"per row \(6, 1\)"):
        dequantize_fp8(weight, torch.ones(3, 1), None, torch.float32, "w")


def test_the_writer_rounds_each_block_to_its_absmax():
    """The checkpoints the tests load are fair FP8 models: every block's peak maps to 448,
    and the round trip is within e4m3's half step (1/16 relative) of each value's block."""
    torch.manual_seed(1)
    weight = torch.randn(70, 90) * torch.logspace(-2, 1, 70)[:, None]
    quantized, scales = quantize_weight(weight, (32, 64))
    assert scales.shape == (math.ceil(70 / 32), math.ceil(90 / 64))
    restored = dequantize_fp8(quantized, scales, (32, 64), torch.float32, "w")
    peak = quantized.float().abs().reshape(-1)
    assert peak.max() == FP8_MAX
    scale_of = scales.repeat_interleave(32, 0)[:70].repeat_interleave(64, 1)[:, :90]
    assert ((restored - weight).abs() <= weight.abs() / 16 + scale_of * 2**-9).all()


def _hf_model(model_dir: Path) -> AutoModelForCausalLM:
    """transformers' model of an FP8 checkpoint, its weights dequantized (on a CPU it does
    that for fp8; compressed-tensors must be told not to fake-quantize activations)."""
    method = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    extra = {}
    if method["quant_method"] == "compressed-tensors":
        extra["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    with warnings.catch_warnings():  # "the model's own quantization_config is used"
        warnings.simplefilter("ignore", UserWarning)
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra)


@pytest.fixture(scope="module")
def fp8_checkpoints(model_factory, tmp_path_factory):
    """(arch, scheme) -> an FP8 copy of the tiny model, cached for the module."""
    made: dict[tuple[str, str], Path] = {}

    def make(arch: str, scheme: str) -> Path:
        if (arch, scheme) not in made:
            out = tmp_path_factory.mktemp("fp8") / f"{arch}-{scheme}"
            made[arch, scheme] = quantize_checkpoint(model_factory(arch), out, scheme, BLOCK)
        return made[arch, scheme]

    return make


@pytest.mark.parametrize(
    ("arch", "scheme"),
    [
        ("llama", "fp8-block"),
        ("qwen3_moe", "fp8-block"),
        ("deepseek_v3", "fp8-block"),  # DeepSeek-V3's release format
        ("llama", "ct-channel"),
        ("llama", "ct-block"),
        ("mixtral", "ct-tensor"),
    ],
)
def test_greedy_tokens_and_prompt_logprobs_equal_transformers(fp8_checkpoints, model_factory,
                                                              arch, scheme):  # fmt: skip
    model_dir = fp8_checkpoints(arch, scheme)
    prompts = random_prompts((9, 40), seed=5)
    hf = _hf_model(model_dir)
    llm = LLM(model_dir, dtype="float32")
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0,
                            prompt_logprobs=1)  # fmt: skip
    outputs = llm.generate(prompts, params, use_tqdm=False)
    with torch.no_grad():
        for prompt, output in zip(prompts, outputs, strict=True):
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS,
                                    min_new_tokens=NUM_TOKENS, do_sample=False)  # fmt: skip
            assert list(output.outputs[0].token_ids) == generated[0, len(prompt) :].tolist()
            reference = hf(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
            for position, lp in enumerate(output.prompt_logprobs[1:]):
                expected = reference[position, lp.token_id].item()
                assert lp.logprob == pytest.approx(expected, abs=1e-4), position
    assert llm.engine.leak_report() == []
    # Not vacuous: the unquantized model's tokens part from these.
    plain = LLM(model_factory(arch), dtype="float32")
    unquantized = plain.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert [o.outputs[0].token_ids for o in unquantized] != tokens


def test_the_load_says_the_fp8_weights_take_the_model_dtypes_memory(fp8_checkpoints, caplog):
    """Operators see why an FP8 checkpoint's weights take bf16 (here float32) memory."""
    caplog.set_level("INFO", logger="engine.models.loader")
    model = _model(fp8_checkpoints("llama", "ct-channel"))
    held = sum(p.numel() * 4 for p in model.parameters()) / 2**30
    assert f"FP8 weights (compressed-tensors) dequantized to torch.float32 at load: {held:.2f} " \
        "GiB held (no FP8 matmuls: W8A16)" in caplog.text  # fmt: skip


def _model(model_dir: Path) -> LlamaForCausalLM:
    return load_model(model_dir, read_arch_config(model_dir), 256, TorchAttentionBackend(16),
                      torch.device("cpu"), torch.float32)  # fmt: skip


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in _model(model_dir).named_parameters()}


def test_every_layout_of_the_same_scales_loads_the_same_weights(fp8_checkpoints, tmp_path):
    """fbgemm_fp8 and compressed-tensors per row store the same numbers under other names,
    as do fp8 and compressed-tensors blocks; and a sharded copy with its scales in another
    shard than their weights loads the same too."""
    channel = _weights(fp8_checkpoints("llama", "ct-channel"))
    fbgemm = _weights(fp8_checkpoints("llama", "fbgemm"))
    assert channel.keys() == fbgemm.keys()
    assert all(torch.equal(channel[name], fbgemm[name]) for name in channel)
    block = _weights(fp8_checkpoints("llama", "fp8-block"))
    ct_block = _weights(fp8_checkpoints("llama", "ct-block"))
    assert all(torch.equal(block[name], ct_block[name]) for name in block)
    assert not torch.equal(block["model.layers.0.self_attn.qkv_proj.weight"],
                           channel["model.layers.0.self_attn.qkv_proj.weight"])  # fmt: skip
    # AutoFP8's fp8 without a block size: 0-d scales, the numbers of compressed-tensors'
    # per-tensor [1] scales.
    per_tensor = _weights(fp8_checkpoints("llama", "ct-tensor"))
    auto_fp8 = _weights(fp8_checkpoints("llama", "fp8-tensor"))
    assert all(torch.equal(per_tensor[name], auto_fp8[name]) for name in per_tensor)
    # ModelOpt's, named in hf_quant_config.json rather than config.json.
    modelopt_dir = fp8_checkpoints("llama", "modelopt")
    assert "quantization_config" not in json.loads((modelopt_dir / "config.json").read_text())
    modelopt = _weights(modelopt_dir)
    assert all(torch.equal(per_tensor[name], modelopt[name]) for name in per_tensor)
    sharded = _sharded(fp8_checkpoints("llama", "fp8-block"), tmp_path / "sharded")
    assert all(torch.equal(block[name], p) for name, p in _weights(sharded).items())


def test_kv_cache_scales_are_read_per_layer_under_each_name(fp8_checkpoints, tmp_path, caplog):
    """llm-compressor's ``self_attn.k_scale``, ModelOpt's ``self_attn.k_proj.k_scale``,
    ``attn.k_scale``, older files' ``k_proj.output_scale`` and ``kv_scale`` (both): one K
    and one V scale per layer, kept for an FP8 KV cache (``test_kv_cache_dtype``); no
    weight changes. Scales an FP8 cache cannot use are recorded, not refused here; scales
    a config does not declare FP8 are ignored."""
    block = fp8_checkpoints("llama", "fp8-block")
    names = {0: ("k_scale", "v_scale"), 1: ("k_proj.k_scale", "v_proj.v_scale"),
             2: ("k_proj.output_scale", "attn.v_scale"), 3: ("kv_scale",)}  # fmt: skip

    def add_kv_scales(tensors):
        for layer, layer_names in names.items():
            for index, name in enumerate(layer_names):
                value = torch.tensor(0.25 + layer + index / 4)
                tensors[f"model.layers.{layer}.self_attn.{name}"] = value

    with_scales = _edited(block, tmp_path / "kv-scales", tensors_edit=add_kv_scales)
    model = _model(with_scales)
    assert model.checkpoint_kv_scales == {0: (0.25, 0.5), 1: (1.25, 1.5), 2: (2.25, 2.5),
                                          3: (3.25, 3.25)}  # fmt: skip
    assert model.kv_scale_problems == ()
    weights = {name: p.detach() for name, p in model.named_parameters()}
    assert all(torch.equal(weights[name], p) for name, p in _weights(block).items())
    assert _model(block).checkpoint_kv_scales == {}

    def unusable(tensors):
        tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([0.1, 0.2])  # per head
        tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(0.0)

    problems = _model(_edited(block, tmp_path / "unusable", tensors_edit=unusable))
    assert len(problems.kv_scale_problems) == 2
    assert "holds 2 torch.float32 values" in problems.kv_scale_problems[0]
    assert "is 0.0, not a positive scale" in problems.kv_scale_problems[1]
    # compressed-tensors without an FP8 kv_cache_scheme: the scales are not FP8 scales.
    channel = fp8_checkpoints("llama", "ct-channel")
    undeclared = _model(_edited(channel, tmp_path / "undeclared", tensors_edit=add_kv_scales))
    assert undeclared.checkpoint_kv_scales == {}
    assert "7 KV-cache scales are ignored" in caplog.text


def test_kv_cache_scales_of_checkpoints_whose_weights_are_not_fp8(tiny_llama, tmp_path):
    """compressed-tensors declares an FP8 KV cache beside integer weights (W4A16 and a
    kv_cache_scheme), or alone (no config groups, float weights): their scales were
    refused as unexpected tensors, the second config as having no config groups."""
    from engine.models.int_weights_maker import quantize_int_checkpoint

    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
              "symmetric": True}  # fmt: skip

    def add_kv_scales(tensors):
        for layer in range(2):
            tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.25 + layer)
            tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.5 + layer)

    def declare(config):
        config["quantization_config"]["kv_cache_scheme"] = scheme

    packed = quantize_int_checkpoint(tiny_llama, tmp_path / "w4a16", "ct-w4a16")
    w4a16 = _edited(packed, tmp_path / "w4a16-kv", declare, add_kv_scales)
    expected = {0: (0.25, 0.5), 1: (1.25, 1.5)}
    assert _model(w4a16).checkpoint_kv_scales == expected
    assert all(torch.equal(_weights(packed)[n], p) for n, p in _weights(w4a16).items())

    def kv_only(config):
        quantization = {"quant_method": "compressed-tensors", "config_groups": {}}
        config["quantization_config"] = {**quantization, "kv_cache_scheme": scheme}

    alone = _edited(tiny_llama, tmp_path / "kv-only", kv_only, add_kv_scales)
    assert _model(alone).checkpoint_kv_scales == expected
    assert all(torch.equal(_weights(tiny_llama)[n], p) for n, p in _weights(alone).items())


def test_gpt_oss_experts_stored_in_fp8_are_refused(model_factory, tmp_path):
    """GPT-OSS's experts go their own way (MXFP4 or 16-bit, stacked, input-major): FP8 ones
    would be cast without their scales, so they are refused by name."""
    gpt_oss = model_factory("gpt_oss")
    experts = "model.layers.0.mlp.experts.gate_up_proj"

    def fp8_experts(tensors):
        tensors[experts] = tensors[experts].to(torch.float8_e4m3fn)
        tensors[f"{experts}_scale"] = torch.ones(1)

    def fp8_config(config):
        config["quantization_config"] = {"quant_method": "fp8"}

    edited = _edited(gpt_oss, tmp_path / "fp8-experts", fp8_config, fp8_experts)
    with pytest.raises(ModelLoadError, match=rf"{experts}: GPT-OSS experts in FP8"):
        _weights(edited)


def test_e8m0_scales_stored_as_exponent_bytes(fp8_checkpoints, tmp_path):
    """``scale_fmt: ue8m0`` (MXFP8-style): uint8 scales are exponents, 2 ** (byte - 127);
    the same powers of two stored as floats load the same weights."""
    block = fp8_checkpoints("llama", "fp8-block")
    exponents: dict[str, torch.Tensor] = {}

    def as_floats(tensors):
        for name in [n for n in tensors if n.endswith("_scale_inv")]:
            exponents[name] = torch.log2(tensors[name]).round()
            tensors[name] = torch.exp2(exponents[name])

    def as_bytes(tensors):
        for name, exponent in exponents.items():
            tensors[name] = (exponent + 127).to(torch.uint8)

    def ue8m0(config):
        config["quantization_config"]["scale_fmt"] = "ue8m0"

    floats = _edited(block, tmp_path / "floats", tensors_edit=as_floats)
    stored_bytes = _edited(floats, tmp_path / "bytes", config_edit=ue8m0, tensors_edit=as_bytes)
    assert exponents and all(e.min() < -3 for e in exponents.values())  # real exponents
    reference = _weights(floats)
    assert all(torch.equal(reference[name], p) for name, p in _weights(stored_bytes).items())


def test_a_tied_model_with_its_own_fp8_head_uses_it(fp8_checkpoints, tmp_path):
    """tie_word_embeddings with an FP8 lm_head stored beside 16-bit embeddings: the head
    is its own (as transformers keeps a stored head that differs), dequantized."""
    block = fp8_checkpoints("llama", "fp8-block")
    head = load_file(block / "model.safetensors")["lm_head.weight"]  # [2048, 256] float32
    quantized, scales = quantize_weight(head, BLOCK)

    def fp8_head(tensors):
        tensors["lm_head.weight"], tensors["lm_head.weight_scale_inv"] = quantized, scales

    def tie(config):
        config["tie_word_embeddings"] = True

    tied = _edited(block, tmp_path / "tied", config_edit=tie, tensors_edit=fp8_head)
    weights = _weights(tied)
    expected = dequantize_fp8(quantized, scales, BLOCK, torch.float32, "lm_head.weight")
    assert torch.equal(weights["lm_head.weight"], expected)


def _sharded(model_dir: Path, out: Path) -> Path:
    """``model_dir`` in two shards, every weight's scale in the other shard from it."""
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(model_dir / "model.safetensors")
    scales = {n: t for n, t in tensors.items() if n.endswith("_scale_inv")}
    rest = {n: t for n, t in tensors.items() if n not in scales}
    save_file(scales, out / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(rest, out / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {n: "model-00001-of-00002.safetensors" for n in scales}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in rest}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def _edited(model_dir: Path, out: Path, config_edit=None, tensors_edit=None) -> Path:
    shutil.copytree(model_dir, out)
    if config_edit is not None:
        config = json.loads((out / "config.json").read_text())
        config_edit(config)
        (out / "config.json").write_text(json.dumps(config))
    if tensors_edit is not None:
        tensors = load_file(out / "model.safetensors")
        tensors_edit(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_broken_or_unsupported_fp8_checkpoints_are_refused_by_name(fp8_checkpoints, tmp_path):
    block = fp8_checkpoints("llama", "fp8-block")
    q_proj = "model.layers.0.self_attn.q_proj.weight"

    def drop_scale(tensors):
        del tensors[f"{q_proj}_scale_inv"]

    no_scale = _edited(block, tmp_path / "no-scale", tensors_edit=drop_scale)
    with pytest.raises(ModelLoadError, match=rf"{q_proj} is stored as torch.float8_e4m3fn "
                                             rf"with no {q_proj}_scale_inv or"):  # fmt: skip
        _weights(no_scale)
    no_config = _edited(block, tmp_path / "no-config",
                        config_edit=lambda c: c.pop("quantization_config"))  # fmt: skip
    with pytest.raises(ModelLoadError, match="names no FP8 quantization_config"):
        _weights(no_config)

    def integer_weight(tensors):
        tensors[q_proj] = tensors[q_proj].view(torch.int8)

    integer = _edited(block, tmp_path / "int8", tensors_edit=integer_weight)
    with pytest.raises(ModelLoadError, match=rf"{q_proj} is stored as torch.int8; only FP8"):
        _weights(integer)

    def byte_scales(tensors):
        tensors[f"{q_proj}_scale_inv"] = torch.full((8, 4), 120, dtype=torch.uint8)

    bytes_unsaid = _edited(block, tmp_path / "uint8-scales", tensors_edit=byte_scales)
    with pytest.raises(ModelLoadError, match=r"q_proj\.weight_scale_inv is stored as torch.uint8"):
        _weights(bytes_unsaid)

    def smoothing(tensors):  # ModelOpt's AWQ-style activation smoothing
        tensors["model.layers.0.self_attn.q_proj.pre_quant_scale"] = torch.ones(256)

    smoothed = _edited(block, tmp_path / "smoothed", tensors_edit=smoothing)
    with pytest.raises(ModelLoadError, match="pre-quantization scales are not supported"):
        _weights(smoothed)

    def other_block(config):
        config["quantization_config"]["weight_block_size"] = [16, 64]

    wrong_block = _edited(block, tmp_path / "wrong-block", config_edit=other_block)
    with pytest.raises(ModelLoadError, match=r"mlp\.down_proj\.weight: scales of shape \(8, 8\) "
                                             r"fit FP8 weight \(256, 512\) neither"):  # fmt: skip
        _weights(wrong_block)


def _ct_group(weights: dict, form: str = "float-quantized") -> dict:
    return {"quant_method": "compressed-tensors", "format": form,
            "config_groups": {"g": {"weights": weights}}}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "gptq", "bits": 4}, r"quantized checkpoints \(gptq\) are not supported"),
        ({"quant_method": "awq"}, "weight quantizations that load: fp8"),
        (
            _ct_group({"num_bits": 4, "type": "int", "strategy": "group"}, "pack-quantized"),
            r"group 'g' stores 4-bit int weights \(pack-quantized\)",
        ),
        (
            _ct_group({"num_bits": 8, "type": "float", "strategy": "tensor_group"}),
            "FP8 weight strategy 'tensor_group' is not supported",
        ),
        ({"quant_method": "compressed-tensors", "config_groups": {}}, "has no config_groups"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3"),
        ({"quant_method": "fp8", "scale_fmt": "e4m3"}, "scale_fmt 'e4m3' is not supported"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo 'NVFP4' is not"),
        (
            _ct_group({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": False}),
            "asymmetric FP8 weights",
        ),
        (
            {
                **_ct_group({"num_bits": 8, "type": "float", "strategy": "channel"}),
                "transform_config": {"config_groups": {"R1": {"type": "hadamard"}}},
            },
            "transform_config",
        ),
        (
            {
                **_ct_group({"num_bits": 8, "type": "float", "strategy": "channel"}),
                "sparsity_config": {"format": "sparse-24-bitmask"},
            },
            "sparsity format 'sparse-24-bitmask' is not supported",
        ),
    ],
)
def test_quantization_configs_that_do_not_load(config, message):
    with pytest.raises(ModelLoadError, match=message):
        read_fp8_config(config, "config.json")


def test_quantization_configs_that_load():
    assert read_fp8_config({"quant_method": "fp8", "weight_block_size": [128, 128]}, "c") == \
        Fp8Weights("fp8", (128, 128))  # fmt: skip
    assert read_fp8_config({"quant_method": "fp8", "activation_scheme": "static"}, "c") == \
        Fp8Weights("fp8")  # fmt: skip
    assert read_fp8_config({"quant_method": "fbgemm_fp8"}, "c") == Fp8Weights("fbgemm_fp8")
    assert read_fp8_config({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "c") == \
        Fp8Weights("fp8", None, "ue8m0")  # fmt: skip
    modelopt = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    assert read_fp8_config(modelopt, "c") == Fp8Weights("modelopt")
    naive = _ct_group({"num_bits": 8, "type": "float", "strategy": "channel"}, "naive-quantized")
    naive["sparsity_config"] = {"format": "dense"}
    assert read_fp8_config(naive, "c") == Fp8Weights("compressed-tensors", fp8_kv_scales=False)
    fp8_kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}
    assert read_fp8_config({**naive, "kv_cache_scheme": fp8_kv}, "c").fp8_kv_scales
    assert not read_fp8_config({**modelopt, "kv_cache_quant_algo": "NVFP4"}, "c").fp8_kv_scales
    block = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}
    channel = {"num_bits": 8, "type": "float", "strategy": "channel"}
    config = _ct_group(block)
    config["config_groups"]["b"] = {"weights": channel}
    assert read_fp8_config(config, "c") == Fp8Weights("compressed-tensors", (128, 128),
                                                      fp8_kv_scales=False)  # fmt: skip


def test_a_multimodal_config_may_hold_it_in_its_text_config(model_factory, tmp_path):
    """compressed-tensors also looks in text_config (a multimodal checkpoint's)."""
    text = json.loads((model_factory("gemma3") / "config.json").read_text())
    text["quantization_config"] = _ct_group({"num_bits": 8, "type": "float",
                                             "strategy": "channel"})  # fmt: skip
    out = tmp_path / "multimodal"
    out.mkdir()
    vision = {"model_type": "siglip_vision_model", "image_size": 896, "patch_size": 14}
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": text, "vision_config": vision}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    assert read_arch_config(out).fp8_weights == Fp8Weights("compressed-tensors",
                                                           fp8_kv_scales=False)  # fmt: skip

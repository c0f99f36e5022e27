"""GPTQ, AWQ and compressed-tensors checkpoints (packed integer weights): the layouts by
hand, the loaded weights equal to the float weights they stand for (bit for bit), and
greedy tokens and prompt log-probs equal to transformers' on those float weights; and what
does not load is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.models.arch import ModelLoadError, read_arch_config
from engine.models.int_weights import dequantize_int
from engine.models.int_weights_config import SCHEMES, IntWeights
from engine.models.int_weights_maker import _pack, quantize_int_checkpoint
from engine.models.lora_maker import make_lora_adapter
from engine.models.weight_count import loaded_weight_count
from tests.engine.helpers import assert_prompt_logprobs_match, hf_greedy, random_prompts

NUM_TOKENS = 12


def _word(value: int) -> int:
    """An unsigned 32-bit pattern as the int32 safetensors stores."""
    return value - (1 << 32) if value >= 1 << 31 else value


def test_the_layouts_by_hand():
    """GPTQ packs rows 0..7 of a column into one word from the low bits up (0x76543210)
    and stores zeros minus one (v1); AWQ packs eight columns of a row in the order
    0, 2, 4, 6, 1, 3, 5, 7 (0x75316420)."""
    ones = torch.ones(1, 8)
    gptq = IntWeights("gptq", 4, 8, zero_offset=1)
    qweight = torch.full((1, 8), _word(0x76543210), dtype=torch.int32)  # [in / 8, out]
    zeros = torch.tensor([[_word(0x77777777)]], dtype=torch.int32)  # 7 + 1 = 8 for each column
    weight = dequantize_int(gptq, qweight, zeros, ones * 0.5, None, torch.float32, "w")
    assert torch.equal(weight, (torch.arange(8.0) - 8).mul(0.5).expand(8, 8))  # [out, in]
    awq = IntWeights("awq", 4, -1)
    qweight = torch.tensor([[_word(0x75316420)]], dtype=torch.int32)  # [in = 1, out / 8]
    weight = dequantize_int(awq, qweight, torch.zeros(1, 1, dtype=torch.int32), ones, None,
                            torch.float32, "w")  # fmt: skip
    assert torch.equal(weight, torch.arange(8.0)[:, None])
    no_zeros = IntWeights("awq", 4, -1, has_zeros=False)  # zero 8
    weight = dequantize_int(no_zeros, qweight, None, ones, None, torch.float32, "w")
    assert torch.equal(weight, torch.arange(8.0)[:, None] - 8)
    # The maker packs the same words.
    assert _pack(torch.arange(8)[None], 4).item() == _word(0x76543210)
    assert _pack(torch.arange(8)[None], 4, [0, 2, 4, 6, 1, 3, 5, 7]).item() == _word(0x75316420)
    assert _pack(torch.tensor([[1, 2, 3, 255]]), 8).item() == _word(0xFF030201)
    # compressed-tensors: GPTQ's words, output-major, cut to weight_shape's columns; signed
    # values stored plus 8 (symmetric: that is the zero).
    ct = IntWeights("compressed-tensors", 4, -1, has_zeros=False)
    words = torch.full((2, 1), _word(0x76543210), dtype=torch.int32)  # [out, in / 8]
    weight = dequantize_int(ct, words, None, torch.ones(2, 1), None, torch.float32, "w", (2, 5))
    assert torch.equal(weight, (torch.arange(5.0) - 8).expand(2, 5))
    # Its zero points pack along the output: [out / 8, groups], here 8 rows of zero 3.
    ct_asym = IntWeights("compressed-tensors", 4, -1)
    zeros = torch.tensor([[_word(0x33333333)]], dtype=torch.int32)
    words = torch.full((8, 1), _word(0x76543210), dtype=torch.int32)
    weight = dequantize_int(ct_asym, words, zeros, torch.ones(8, 1), None, torch.float32, "w")
    assert torch.equal(weight, (torch.arange(8.0) - 3).expand(8, 8))
    # Act-order: g_idx picks each row's group.
    two_zeros = torch.tensor([[_word(0x77777777)], [_word(0x33333333)]], dtype=torch.int32)
    weight = dequantize_int(IntWeights("gptq", 4, 4, zero_offset=1),
                            torch.full((1, 8), _word(0x76543210), dtype=torch.int32), two_zeros,
                            torch.stack([ones[0], ones[0] * 2]), torch.tensor([1, 0] * 4),
                            torch.float32, "w")  # fmt: skip
    rows = torch.arange(8.0)
    expected = torch.where(rows % 2 == 0, (rows - 4) * 2, rows - 8)  # group 1, group 0
    assert torch.equal(weight, expected.expand(8, 8))


def _quantized(model_dir, tmp_path, scheme: str):
    """(packed, dequantized): the checkpoint in ``scheme`` and the floats it stands for."""
    dequantized = tmp_path / "dequantized"
    packed = quantize_int_checkpoint(model_dir, tmp_path / "packed", scheme,
                                     dequantized_out=dequantized)  # fmt: skip
    return packed, dequantized


def _weights(model_dir, **kwargs) -> dict[str, torch.Tensor]:
    llm = LLM(model_dir, dtype="float32", **kwargs)
    return {k: v.clone() for k, v in llm.engine.runner.shard.model.state_dict().items()}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_loaded_weights_are_the_dequantized_ones(model_factory, tmp_path, scheme):
    """Every parameter, fused ones too, equals the float checkpoint's bit for bit."""
    packed, dequantized = _quantized(model_factory("llama"), tmp_path, scheme)
    assert read_arch_config(packed).int_weights is not None
    got, expected = _weights(packed), _weights(dequantized)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    files = load_file(str(packed / "model.safetensors"))
    left_float = {name for name in files if name.endswith("proj.weight")}
    if scheme != "gptq-dynamic":
        assert not left_float
        return
    # GPTQModel's rules: layer 3's MLP unquantized; layer 1 in 8 bits (4 values a word)
    # and groups of 64; the rest in 4 bits and groups of 32. (down_proj: 512 in, 256 out.)
    assert left_float == {f"model.layers.3.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    down = "model.layers.{}.mlp.down_proj."
    assert files[down.format(1) + "qweight"].shape == (512 // 4, 256)
    assert files[down.format(1) + "scales"].shape == (512 // 64, 256)
    assert files[down.format(0) + "qweight"].shape == (512 // 8, 256)
    assert files[down.format(0) + "scales"].shape == (512 // 32, 256)


@pytest.mark.parametrize(
    ("arch", "scheme", "tp"),
    [("llama", "gptq-act-order", 1), ("llama", "awq", 2), ("qwen3_moe", "gptq", 1),
     ("mixtral", "awq", 1), ("qwen3", "ct-w4a16-asym-act-order", 1)],
)  # fmt: skip
def test_greedy_and_logprob_parity_with_transformers(model_factory, tmp_path, arch, scheme, tp):
    """The packed checkpoint's greedy tokens and prompt log-probs are transformers' on the
    float weights it stands for: dense and MoE (Qwen3's and Mixtral's expert names), and
    split over 2 ranks (AWQ's groups cut with the rows)."""
    packed, dequantized = _quantized(model_factory(arch), tmp_path, scheme)
    prompts = random_prompts((20, 45), seed=3)
    expected = hf_greedy(dequantized, prompts, NUM_TOKENS)
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0)
    with LLM(packed, dtype="float32", tensor_parallel_size=tp) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        assert llm.engine.leak_report() == []
    if tp == 1:
        assert_prompt_logprobs_match(packed, prompts[1], reference_dir=dequantized)


def _edit(model_dir, tensors=None, quantization=None) -> None:
    if tensors is not None:
        weights = load_file(str(model_dir / "model.safetensors"))
        tensors(weights)
        save_file(weights, str(model_dir / "model.safetensors"))
    if quantization is not None:
        config = json.loads((model_dir / "config.json").read_text())
        config["quantization_config"].update(quantization)
        (model_dir / "config.json").write_text(json.dumps(config))


def test_what_does_not_load_is_refused_by_name(tiny_llama, tmp_path):
    name = "model.layers.1.mlp.down_proj"
    cases = [
        ({"bits": 3}, None, "gptq bits=3 is not supported"),
        ({"checkpoint_format": "marlin"}, None, "checkpoint_format 'marlin'"),
        ({"group_size": 0}, None, "group_size must be a positive integer or -1"),
        ({"group_size": 64}, None, r"layers\.0\.mlp\.down_proj: scales \(16, 256\) and zeros "
                                   r"\(16, 256\) do not fit a 512 x 256 weight in 8 groups of 64"),
        ({"dynamic": {"-:model\\.layers\\.0\\.": {}}}, None,
         r"layers\.0\.\S+\.qweight: the quantization_config's dynamic rules leave this module "
         "unquantized"),
        ({"dynamic": {"+:(": {}}}, None, r"dynamic rule '\+:\(': missing \)"),
        ({"dynamic": {"+:x": {"bits": 5}}}, None, r"dynamic rule '\+:x': bits=5"),
        (None, lambda t: t.pop(f"{name}.scales"), f"{name}.qweight has no {name}.scales"),
        (None, lambda t: t.update({f"{name}.g_idx": t[f"{name}.g_idx"] + 100}),
         f"{name}.g_idx .512,. does not name one of 16 groups"),
        (None, lambda t: t.update({f"{name}.qweight": t[f"{name}.qweight"].float()}),
         f"{name}.qweight is stored as torch.float32"),
    ]  # fmt: skip
    for i, (quantization, tensors, match) in enumerate(cases):
        packed = quantize_int_checkpoint(tiny_llama, tmp_path / str(i), "gptq")
        _edit(packed, tensors, quantization)
        with pytest.raises(ModelLoadError, match=match):
            LLM(packed, dtype="float32")
    packed = quantize_int_checkpoint(tiny_llama, tmp_path / "awq", "awq")
    _edit(packed, quantization={"version": "gemv"})
    with pytest.raises(ModelLoadError, match="awq 4-bit 'gemv' weights are not supported"):
        LLM(packed, dtype="float32")
    _edit(packed, quantization={"quant_method": "hqq"})
    with pytest.raises(ModelLoadError, match=r"\(hqq\) are not supported.*gptq \(2/4/8"):
        LLM(packed, dtype="float32")


def test_a_deployment_counts_the_weights_as_held(tiny_llama, tmp_path):
    """Pods are sized by the weights the engine holds: packed words count 32 / bits
    weights each; scales, zeros and group indices none."""
    for scheme in ("gptq", "gptq-8bit", "gptq-dynamic", "awq", "ct-w4a16-asym-act-order"):
        packed = quantize_int_checkpoint(tiny_llama, tmp_path / scheme, scheme)
        assert loaded_weight_count(packed) == loaded_weight_count(tiny_llama), scheme
    # A multimodal checkpoint may keep compressed-tensors' config in its text_config, where
    # the loader finds it too (fp8_config.read_quantization_config).
    config = json.loads((packed / "config.json").read_text())
    config["text_config"] = {"quantization_config": config.pop("quantization_config")}
    (packed / "config.json").write_text(json.dumps(config))
    assert loaded_weight_count(packed) == loaded_weight_count(tiny_llama)


def test_compressed_tensors_layouts_that_do_not_load_are_refused(tiny_llama, tmp_path):
    def group(**changes) -> dict:
        config, _ = SCHEMES["ct-w4a16"]
        group = config["config_groups"]["group_0"]
        return {"config_groups": {"group_0": {**group, "format": "pack-quantized", **changes}}}

    weights = SCHEMES["ct-w4a16"][0]["config_groups"]["group_0"]["weights"]
    cases = [
        (group(format="int-quantized"), "as 'int-quantized'; only pack-quantized ones load"),
        (group(input_activations={"num_bits": 8, "type": "int"}), "activations too"),
        (group(weights={**weights, "num_bits": 2}), "2-bit group weights are not supported"),
        ({"config_groups": {"a": group()["config_groups"]["group_0"],
                            "b": {**group()["config_groups"]["group_0"],
                                  "weights": {**weights, "group_size": 64}}}},
         "use different layouts"),
    ]  # fmt: skip
    for i, (quantization, match) in enumerate(cases):
        packed = quantize_int_checkpoint(tiny_llama, tmp_path / str(i), "ct-w4a16")
        config = json.loads((packed / "config.json").read_text())
        config["quantization_config"].update(quantization)
        config["quantization_config"]["format"] = None
        (packed / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelLoadError, match=match):
            LLM(packed, dtype="float32")


def test_lora_adapters_on_a_packed_base(tiny_llama, tmp_path):
    """An adapter served over a GPTQ base computes what it does over the float weights
    that base stands for (the QLoRA-style deployment), mixed with base-model rows."""
    packed, dequantized = _quantized(tiny_llama, tmp_path, "gptq")
    adapter = make_lora_adapter(tiny_llama, tmp_path / "adapter", seed=3)
    prompts = random_prompts((20, 33), seed=6)
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0)
    names = ["alice", None]
    runs = []
    for base in (packed, dequantized):
        llm = LLM(base, dtype="float32", lora_adapters={"alice": adapter})
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_name=names)
        runs.append([o.outputs[0].token_ids for o in outputs])
        assert llm.engine.leak_report() == []
    assert runs[0] == runs[1]
    plain = LLM(packed, dtype="float32").generate(prompts[:1], params, use_tqdm=False)
    assert runs[0][0] != plain[0].outputs[0].token_ids  # the adapter changes the tokens

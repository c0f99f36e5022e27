"""bitsandbytes 4-bit checkpoints (NF4 and FP4, with and without double quantization),
written by transformers with bitsandbytes itself on this CPU: every loaded weight equals
bitsandbytes' own dequantization bit for bit, and greedy tokens and prompt log-probs equal
transformers' on those float weights (transformers' 4-bit layers on a CPU compute in a
lower precision, 0.02 off per projection here, so they are not the oracle); and what
does not load is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.models.arch import ModelLoadError
from engine.models.weight_count import loaded_weight_count
from tests.engine.helpers import assert_prompt_logprobs_match, hf_greedy, random_prompts

bnb = pytest.importorskip("bitsandbytes")
NUM_TOKENS = 12


def _bnb_checkpoint(model_dir: Path, out: Path, quant_type: str, double_quant: bool):
    """(bnb, dequantized): ``model_dir`` saved by transformers with bitsandbytes' 4-bit
    layers, and a float checkpoint of what bitsandbytes dequantizes each of them to."""
    from bitsandbytes.functional import dequantize_4bit
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_use_double_quant=double_quant,
                                bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=config, device_map="cpu", dtype=torch.float32
    )
    quantized, dequantized = out / "bnb", out / "dequantized"
    model.save_pretrained(quantized)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = dequantize_4bit(module.weight.data, module.weight.quant_state)
            tensors[f"{name}.weight"] = weight.float().contiguous()
    shutil.copytree(model_dir, dequantized)
    save_file(tensors, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    for path in model_dir.iterdir():  # the tokenizer's files
        if path.name.startswith("tokenizer") or path.suffix == ".jinja":
            shutil.copy(path, quantized / path.name)
    return quantized, dequantized


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", True), ("fp4", False)])
def test_loaded_weights_and_parity(tiny_llama, tmp_path, quant_type, double_quant):
    quantized, dequantized = _bnb_checkpoint(tiny_llama, tmp_path, quant_type, double_quant)
    files = load_file(str(quantized / "model.safetensors"))
    packed = [n for n, t in files.items() if t.dtype == torch.uint8 and n.endswith(".weight")]
    assert len(packed) == 4 * 7  # every projection of the 4 layers, not the head
    assert any(n.endswith(".nested_absmax") for n in files) == double_quant
    got = LLM(quantized, dtype="float32").engine.runner.shard.model.state_dict()
    expected = LLM(dequantized, dtype="float32").engine.runner.shard.model.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    prompts = random_prompts((20, 45), seed=3)
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0)
    llm = LLM(quantized, dtype="float32")
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens == hf_greedy(dequantized, prompts, NUM_TOKENS)
    assert llm.engine.leak_report() == []
    assert_prompt_logprobs_match(quantized, prompts[1], reference_dir=dequantized)
    assert loaded_weight_count(quantized) == loaded_weight_count(tiny_llama)


def test_what_does_not_load_is_refused_by_name(tiny_llama, tmp_path):
    quantized, _ = _bnb_checkpoint(tiny_llama, tmp_path / "nf4", "nf4", True)
    config = json.loads((quantized / "config.json").read_text())

    def refused(changes: dict, match: str) -> None:
        q = {**config["quantization_config"], **changes}
        (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": q}))
        with pytest.raises(ModelLoadError, match=match):
            LLM(quantized, dtype="float32")

    refused({"load_in_8bit": True, "load_in_4bit": False}, r"8-bit \(LLM.int8\(\)\)")
    refused({"bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type 'int4' is not supported")
    refused({"bnb_4bit_quant_storage": "bfloat16"}, "quant_storage 'bfloat16'")
    (quantized / "config.json").write_text(json.dumps(config))
    name = "model.layers.2.mlp.down_proj.weight"
    tensors = load_file(str(quantized / "model.safetensors"))
    tensors.pop(f"{name}.absmax")
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"{name}: a bitsandbytes 4-bit weight without"):
        LLM(quantized, dtype="float32")

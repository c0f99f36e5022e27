"""Prompts and references shared by engine tests."""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PROMPT_LENGTHS = (5, 17, 33, 50, 64, 71, 100, 130)  # several longer than 3 blocks of 16


def random_prompts(lengths=PROMPT_LENGTHS, seed: int = 0, vocab: int = 2000) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids from 5 up: skip the special tokens (pad, bos, eos, chat markers).
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


def sampled_logprobs(output) -> list[float]:
    """The log-prob of each token a request sampled (``SamplingParams.logprobs=0``)."""
    return [entry.logprob for entry in output.outputs[0].logprobs]


def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    num_tokens: int,
    processors: Callable[[int], list] | None = None,
    adapter_dir: Path | None = None,
    new_cache: Callable[[Any], Any] | None = None,
    **generate_kwargs: Any,
) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time (no padding), EOS banned like
    ``min_tokens=num_tokens``. ``processors(prompt_len)`` adds logits processors;
    ``adapter_dir``: a LoRA adapter, applied by ``peft``; ``new_cache(config)``: a fresh
    cache for each prompt; ``generate_kwargs`` go to ``generate`` (``repetition_penalty``,
    say)."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            extra = processors(len(prompt)) if processors else []
            if new_cache is not None:
                generate_kwargs["cache"] = new_cache(model.config)
            generated = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
                logits_processor=LogitsProcessorList(extra),
                **generate_kwargs,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def gemma3_multimodal_checkpoint(text_dir: Path, out: Path) -> Path:
    """``Gemma3ForConditionalGeneration`` (a tiny SigLIP tower) around ``text_dir``'s
    language model: the layout of Gemma 3 4B and up."""
    import transformers

    text = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text.config, vision_config=vision, mm_tokens_per_image=4
    )
    torch.manual_seed(1)
    model = transformers.Gemma3ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.generation_config = text.generation_config
    model.save_pretrained(out)
    for path in text_dir.iterdir():  # the tokenizer's files
        if path.name.startswith("tokenizer") or path.name.endswith(".jinja"):
            shutil.copy(path, out / path.name)
    return out


def assert_prompt_logprobs_match(
    model_dir: Path, prompt: list[int], reference_dir: Path | None = None, **llm_kwargs: Any
) -> None:
    """Every prompt position's log-probs (the token's and the top 5) equal transformers'
    (on ``reference_dir``, by default the same files) within 1e-4: what greedy tokens
    alone cannot see."""
    import pytest
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(reference_dir or model_dir, dtype=torch.float32)
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    llm = LLM(model_dir, dtype="float32", **llm_kwargs)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    for position, lp in enumerate(output.prompt_logprobs[1:]):
        expected = reference[position]
        assert lp.logprob == pytest.approx(expected[lp.token_id].item(), abs=1e-4), position
        assert list(lp.top_logprobs) == pytest.approx(expected.topk(5).values.tolist(), abs=1e-4)
    assert llm.engine.leak_report() == []


def headless_copy(model_dir: Path, out: Path) -> Path:
    """The checkpoint's backbone alone, as embedding checkpoints ship it (Qwen3-Embedding's
    files): no ``lm_head.weight``, names without the ``model.`` prefix."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
            continue
        tensors = load_file(path)
        bare = {k.removeprefix("model."): v for k, v in tensors.items() if k != "lm_head.weight"}
        save_file(bare, out / path.name, metadata={"format": "pt"})
    return out


def hf_last_logits(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' next-token logits after each prompt, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [model(input_ids=torch.tensor([prompt])).logits[0, -1] for prompt in prompts]


def add_kv_scales(model_dir: Path, scales: dict[int, tuple[float, float]]) -> None:
    """Store calibrated KV-cache scales in ``model_dir``'s (one) weights file, odd layers
    under ModelOpt's names (``k_proj.k_scale``), even ones under llm-compressor's."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    names = (("k_scale", "v_scale"), ("k_proj.k_scale", "v_proj.v_scale"))
    for layer, (k_scale, v_scale) in scales.items():
        k_name, v_name = names[layer % 2]
        tensors[f"model.layers.{layer}.self_attn.{k_name}"] = torch.tensor(k_scale)
        tensors[f"model.layers.{layer}.self_attn.{v_name}"] = torch.tensor(v_scale)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


def save_plain_target_adapter(base: torch.nn.Module, out: Path) -> Path:
    """A PEFT adapter on ``base`` with plain targets (``q_proj``, ``v_proj``,
    ``down_proj``: on a vision-language model they wrap its tower's projections of those
    names too), its B matrices random (PEFT starts them at zero: an adapter that changes
    nothing), saved to ``out``."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(base, config)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out

"""EAGLE-3 heads as drafters (``engine.speculative_method: eagle3``,
``engine/models/eagle3.py``): their drafts against a reference computed in plain torch on
transformers' own hidden states, an oracle head whose every draft is kept, the head's KV
moving with the prompt's blocks, and the heads and configs that are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

from benchmarks.draft_model import bigram_checkpoint
from benchmarks.eagle3 import oracle_eagle3_head
from common.config import PdserveConfig, Role
from common.config_base import ConfigError
from common.config_loader import build
from common.engine_config import EngineConfig
from common.kv_budget import ModelShape, kv_budgets
from deploy.cli import main
from engine import LLM, LLMEngine, SamplingParams
from engine.models.arch import ModelLoadError
from engine.models.eagle3_maker import make_eagle3_head
from tests.engine.helpers import random_prompts
from tests.engine.local_puller import LocalPuller
from tests.engine.models.test_mtp import _run_recording_drafts, checked_drafts
from tests.engine.test_disaggregation import hand_off

POOL = dict(dtype="float32", kv_cache_bytes=32 << 20)


def _eagle(head: Path, k: int = 3, **more) -> dict:
    return dict(POOL, speculative_method="eagle3", draft_model=str(head),
                num_speculative_tokens=k, **more)  # fmt: skip


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class ReferenceEagle3:
    """The head computed in plain torch over whole sequences (no KV cache): the target's
    states entering its aux layers from transformers (hooks on its decoder layers and
    final norm), the head's attention with transformers' rotary embedding and causal
    SDPA over all rows."""

    def __init__(self, target_dir: Path, head_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        config = json.loads((head_dir / "config.json").read_text())
        num_layers = self.target.config.num_hidden_layers
        self.aux_ids = config.get("eagle_aux_hidden_state_layer_ids") or [
            2, num_layers // 2, num_layers - 3,
        ]  # fmt: skip
        self.eps, self.before = config["rms_norm_eps"], config.get("norm_before_residual", False)
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.heads
        self.w = load_file(str(head_dir / "model.safetensors"))
        self.embed = self.w.get("embed_tokens.weight", self.target.model.embed_tokens.weight)
        self.d2t = torch.arange(len(self.w["d2t"])) + self.w["d2t"]
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**config))

    @torch.no_grad()
    def _aux(self, token_ids: list[int]) -> list[torch.Tensor]:
        layers = self.target.model.layers
        seen: dict[int, torch.Tensor] = {}

        def keep(index: int):
            def hook(_module, args, kwargs):
                seen[index] = (args[0] if args else kwargs["hidden_states"])[0]

            return hook

        modules = [*layers, self.target.model.norm]
        hooks = [modules[i].register_forward_pre_hook(keep(i), with_kwargs=True)
                 for i in set(self.aux_ids)]  # fmt: skip
        try:
            self.target(input_ids=torch.tensor([token_ids]))
        finally:
            for hook in hooks:
                hook.remove()
        return [seen[i] for i in self.aux_ids]

    def _layer(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        w, p, n = self.w, "midlayer.", len(embeds)
        normed = _rms(features, w[p + "hidden_norm.weight"], self.eps)
        residual = normed if self.before else features
        x = torch.cat((_rms(embeds, w[p + "input_layernorm.weight"], self.eps), normed), -1)

        def proj(name: str, inputs: torch.Tensor) -> torch.Tensor:
            return F.linear(inputs, w[f"{p}{name}.weight"], w.get(f"{p}{name}.bias"))

        def heads(t: torch.Tensor, count: int) -> torch.Tensor:  # [n, c*D] -> [1, c, n, D]
            return t.reshape(1, n, count, self.head_dim).transpose(1, 2)

        q = heads(proj("self_attn.q_proj", x), self.heads)
        k = heads(proj("self_attn.k_proj", x), self.kv_heads)
        v = heads(proj("self_attn.v_proj", x), self.kv_heads)
        cos, sin = self.rotary(v, torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        hidden = residual + proj("self_attn.o_proj", out.transpose(1, 2).reshape(n, -1))
        m = _rms(hidden, w[p + "post_attention_layernorm.weight"], self.eps)
        mlp = F.silu(proj("mlp.gate_proj", m)) * proj("mlp.up_proj", m)
        return hidden + proj("mlp.down_proj", mlp)

    @torch.no_grad()
    def drafts(self, token_ids: list[int], last: int, num_drafts: int) -> list[torch.Tensor]:
        """The head's logits ([draft vocab] rows) of the drafts after position ``last``:
        the head over positions 0..last (fed ``token_ids[1 : last + 2]``), then one more
        row per draft, fed its own last state and draft (greedy)."""
        features = torch.cat(self._aux(token_ids[: last + 1]), -1) @ self.w["fc.weight"].T
        embeds = self.embed[torch.tensor(token_ids[1 : last + 2])]
        rows = []
        for _ in range(num_drafts):
            hidden = self._layer(embeds, features)
            logits = _rms(hidden[-1], self.w["norm.weight"], self.eps) @ self.w["lm_head.weight"].T
            rows.append(logits)
            draft = self.d2t[int(logits.argmax())]
            embeds = torch.cat((embeds, self.embed[draft][None]))
            features = torch.cat((features, hidden[-1:]))
        return rows


# fmt: off
HEADS = {
    # The readers' default aux layers (2, L/2, L - 3), a draft vocabulary of 512 ids.
    "default": dict(draft_vocab_size=512),
    # Every option: its own layers and embeddings, the speculators residual, biases.
    "options": dict(
        draft_vocab_size=2048, aux_layer_ids=(0, 2, 4), own_embeddings=True,
        norm_before_residual=True, attention_bias=True,
    ),
}
# fmt: on


@pytest.mark.parametrize("variant", sorted(HEADS))
def test_drafts_equal_the_reference_head(tiny_llama, tmp_path, variant):
    """Three drafts after every step of three requests (prompts in 32-token chunks, then
    again over their cached prefixes): each is the reference's greedy draft at the same
    point (rows whose top two logits lie within 1e-3 are skipped as ties)."""
    head = make_eagle3_head(tiny_llama, tmp_path / "head", seed=5, **HEADS[variant])
    reference = ReferenceEagle3(tiny_llama, head)
    prompts = random_prompts((40, 75, 100), seed=11)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    engine = LLMEngine(tiny_llama, EngineConfig(**_eagle(head), max_num_batched_tokens=32))

    def token_of(row: torch.Tensor) -> int:  # the head's draft ids are mapped by d2t
        return int(reference.d2t[int(row.argmax())])

    assert checked_drafts(engine, prompts, params, reference.drafts, token_of) >= 30
    assert engine.leak_report() == []


@pytest.fixture(scope="module")
def oracle(tiny_llama, tmp_path_factory) -> tuple[Path, Path]:
    """(target, head): the tiny llama as a bigram table and a head that drafts exactly
    what it samples (``oracle_eagle3_head``)."""
    scratch = tmp_path_factory.mktemp("eagle3-oracle")
    target = bigram_checkpoint(tiny_llama, scratch / "target")
    return target, oracle_eagle3_head(target, scratch / "head")


def test_right_drafts_are_all_kept_and_save_steps(oracle):
    """Every draft is kept (the recursive ones too) and the tokens are those of decoding
    without drafts, in a quarter of the decode steps."""
    target, head = oracle
    prompts = random_prompts((20, 50), seed=2)
    params = SamplingParams(max_tokens=33, min_tokens=33, temperature=0)
    plain = LLM(target, **POOL).generate(prompts, params, use_tqdm=False)
    llm = LLM(target, **_eagle(head))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    scheduler = llm.engine.scheduler
    assert scheduler.num_draft_tokens == scheduler.num_accepted_tokens == 2 * 8 * 3
    assert llm.engine.num_steps == 1 + 8  # the prompts, then 4 tokens a step
    assert llm.engine.leak_report() == []


def test_the_heads_kv_moves_with_the_prompts_blocks(tiny_llama, tmp_path):
    """Prefill on one engine, decode on another: the decode engine's drafts after every
    step (a random head's, which read the whole prompt's head KV) equal those of one
    engine doing both, so the head's KV of the prompt (the last cache layer) came with
    the blocks; and the prefill engine's drafts went out with the first token."""
    head = make_eagle3_head(tiny_llama, tmp_path / "head", seed=5, **HEADS["default"])
    config = EngineConfig(**_eagle(head))
    prompts = random_prompts((40, 75, 100), seed=4)
    params = SamplingParams(max_tokens=10, min_tokens=10, temperature=0)
    colocated = LLMEngine(tiny_llama, config)
    for i, prompt in enumerate(prompts):
        colocated.add_request(f"r{i}", prompt, params)
    _, expected = _run_recording_drafts(colocated)
    puller = LocalPuller()
    prefill = LLMEngine(tiny_llama, config)
    decode = LLMEngine(tiny_llama, config, kv_puller=puller)
    puller.sources["prefill-0"], puller.target = prefill, decode
    assert len(prefill.runner.kv_caches) == 5  # 4 layers and the head's
    shape = ModelShape.read(tiny_llama)
    assert shape.bytes_per_block(16, 4, draft_layer=True) == prefill.runner.bytes_per_block
    firsts = hand_off(prefill, decode, prompts, params)
    _, got = _run_recording_drafts(decode)
    assert puller.num_blocks_pulled > 0
    for i, prompt in enumerate(prompts):
        assert firsts[f"r{i}"].draft_token_ids == expected[f"r{i}"][len(prompt) + 1]
        assert got[f"r{i}"] == expected[f"r{i}"]
    assert decode.scheduler.num_draft_tokens == colocated.scheduler.num_draft_tokens
    for i in range(len(prompts)):
        assert prefill.release_kv(f"r{i}")
    for engine in (colocated, prefill, decode):
        assert engine.leak_report() == []


def test_tensor_parallel_drafts_equal_one_rank(tiny_llama, tmp_path):
    """Over 2 ranks (the head's layer split as the target's, its o_proj bias on rank 0
    only, the rest replicated; its passes sent to the other rank as ``MtpPass``): the
    same drafts after every step as one process, and the same tokens."""
    head = make_eagle3_head(tiny_llama, tmp_path / "head", seed=5, **HEADS["options"])
    prompts = random_prompts((30, 70), seed=8)
    params = SamplingParams(max_tokens=10, min_tokens=10, temperature=0)
    recorded = []
    for tp_size in (1, 2):
        engine = LLMEngine(tiny_llama, EngineConfig(**_eagle(head), tensor_parallel_size=tp_size))
        try:
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{i}", prompt, params)
            outputs, drafts = _run_recording_drafts(engine)
            assert engine.leak_report() == []
        finally:
            engine.close()
        recorded.append(({r: o.outputs[0].token_ids for r, o in outputs.items()}, drafts))
    (one_tokens, one_drafts), (tp_tokens, tp_drafts) = recorded
    assert tp_tokens == one_tokens
    assert tp_drafts == one_drafts and all(one_drafts.values())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_random_heads_drafts_never_change_the_tokens(tiny_llama, tmp_path, temperature):
    head = make_eagle3_head(tiny_llama, tmp_path / "head", draft_vocab_size=256, seed=1)
    prompts = random_prompts((30, 60, 9), seed=3)
    params = SamplingParams(max_tokens=20, min_tokens=20, temperature=temperature, seed=7)
    plain = LLM(tiny_llama, **POOL).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_llama, **_eagle(head, k=2))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.scheduler.num_draft_tokens > 0
    assert llm.engine.leak_report() == []


def _rewrite(head: Path, **changes) -> None:
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, **changes}))


def test_bad_heads_are_refused(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match="eagle3 needs the draft's checkpoint") as error:
        EngineConfig(speculative_method="eagle3")
    assert error.value.key == "engine.draft_model"

    def refused(head_dir: Path, error: type[Exception], match: str, **more) -> None:
        with pytest.raises(error, match=match) as caught:
            LLMEngine(tiny_llama, EngineConfig(**_eagle(head_dir), **more))
        if error is ConfigError:
            assert caught.value.key == "engine.draft_model"

    refused(tiny_llama, ConfigError, "name no EAGLE-3 head")  # a model, not a head
    refused(tmp_path / "nowhere", ConfigError, "holds no config.json")
    cases = [
        ("kv", {"num_key_value_heads": 4}, ConfigError, "4 KV heads of 64.*target's .2 of 64"),
        ("aux", {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}, ConfigError, "0..4"),
        ("width", {"target_hidden_size": 512}, ConfigError, "width 512"),
        (
            "embeds",
            {"hidden_size": 128, "target_hidden_size": 256},
            ConfigError,
            "width 128 is not the target's 256",
        ),
        ("eagle1", {"eagle_config": {"use_aux_hidden_state": False}}, ConfigError, "EAGLE-1"),
    ]
    for name, changes, error, match in cases:
        bad = make_eagle3_head(tiny_llama, tmp_path / name, draft_vocab_size=64)
        _rewrite(bad, **changes)
        refused(bad, error, match)
    # 3 query heads (of 64 dims, KV heads still the target's) do not split over 2 ranks.
    bad = make_eagle3_head(tiny_llama, tmp_path / "split", draft_vocab_size=64)
    tensors = load_file(str(bad / "model.safetensors"))
    attn = "midlayer.self_attn."
    tensors[attn + "q_proj.weight"] = tensors[attn + "q_proj.weight"][:192].contiguous()
    tensors[attn + "o_proj.weight"] = tensors[attn + "o_proj.weight"][:, :192].contiguous()
    save_file(tensors, str(bad / "model.safetensors"))
    _rewrite(bad, num_attention_heads=3, head_dim=64)
    refused(bad, ConfigError, "3 attention heads do not split over 2 ranks", tensor_parallel_size=2)
    for name, edit, match in (
        ("missing", lambda t: t.pop("midlayer.hidden_norm.weight"), "stores no midlayer.hidden"),
        ("d2t", lambda t: t["d2t"].add_(5000), "outside the target's vocabulary"),
        ("extra", lambda t: t.update(stray=torch.zeros(1)), "unexpected tensors.*stray"),
    ):
        bad = make_eagle3_head(tiny_llama, tmp_path / name, draft_vocab_size=64)
        tensors = load_file(str(bad / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(bad / "model.safetensors"))
        refused(bad, ConfigError if name == "d2t" else ModelLoadError, match)


def test_config_check_counts_the_heads_kv_layer(tiny_llama, tmp_path, capsys):
    """``pdserve config check`` sizes the pool with the head's cache layer (the engine's
    pool), and refuses a head whose attention is not the target's or does not split."""
    head = make_eagle3_head(tiny_llama, tmp_path / "head", draft_vocab_size=64)
    layout = tmp_path / "layout.yaml"
    layout.write_text(
        f"model: {tiny_llama}\n"
        "engine: {speculative_method: eagle3, num_speculative_tokens: 2, "
        f"draft_model: {head}, device: cpu, dtype: float32, kv_cache_bytes: 33554432}}\n"
    )
    config = build(PdserveConfig, yaml.safe_load(layout.read_text()))
    budget = kv_budgets(config)[0]
    engine = LLMEngine(tiny_llama, config.engine_for(Role.DECODE))
    assert budget.cpu_bytes_per_block == engine.runner.bytes_per_block
    assert budget.num_blocks == engine.runner.num_blocks
    assert engine.leak_report() == []
    assert main(["config", "check", str(layout)]) == 0
    _rewrite(head, num_key_value_heads=4)
    assert main(["config", "check", str(layout)]) == 2
    err = capsys.readouterr().err
    assert f"error: engine.draft_model: {head}'s attention (4 KV heads of 64)" in err
    _rewrite(head, num_key_value_heads=2, num_attention_heads=3, head_dim=64)
    assert main(["config", "check", str(layout), "--set", "engine.tensor_parallel_size=2"]) == 2
    assert "3 attention heads do not split over 2 ranks" in capsys.readouterr().err


def test_both_roles_need_the_same_head():
    """The head's KV moves with the prompt's blocks: another head could not read it."""
    engine = {"speculative_method": "eagle3", "draft_model": "/heads/a"}
    with pytest.raises(ConfigError, match="both roles need the same head") as error:
        build(PdserveConfig, {"engine": engine, "decode": {"engine": {"draft_model": "/b"}}})
    assert error.value.key == "decode.engine.draft_model"
    config = build(PdserveConfig, {"engine": engine})
    assert {config.engine_for(role).draft_model for role in Role} == {"/heads/a"}

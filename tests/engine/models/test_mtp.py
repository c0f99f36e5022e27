"""DeepSeek-V3's and GLM-4.5's multi-token-prediction layer as a draft model
(``engine.speculative_method: mtp``): its drafts against a reference built from
transformers' own decoder layer, its KV moved with the prompt's blocks, and a checkpoint
whose MTP layer predicts exactly what the model samples, so every draft is kept."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.mtp import oracle_mtp_checkpoint
from common.config import PdserveConfig, Role
from common.config_base import ConfigError
from common.config_loader import build
from common.engine_config import EngineConfig, SpeculativeMethod
from common.kv_budget import ModelShape
from deploy.cli import main
from engine import LLM, LLMEngine, SamplingParams
from engine.models.arch import ModelLoadError
from engine.models.maker import add_qwen_mtp_layer
from tests.engine.helpers import random_prompts
from tests.engine.local_puller import LocalPuller
from tests.engine.test_disaggregation import hand_off

MTP = {"speculative_method": "mtp", "dtype": "float32"}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class ReferenceMtp:
    """The MTP layer computed with transformers: the target's hidden states after its
    final norm (a hook on the norm: what DeepSeek's own modeling code hands the layer),
    and the layer as a one-layer model of the same architecture (its decoder layer,
    ``shared_head.norm`` as the final norm, the model's head) fed ``eh_proj([enorm(embed(
    t_{q+1})), hnorm(h_q)])`` as input embeddings; a further draft reads the last one's
    states after that norm."""

    def __init__(self, model_dir: Path, tmp_path: Path) -> None:
        from transformers import AutoModelForCausalLM

        config = json.loads((model_dir / "config.json").read_text())
        num_layers, self.eps = config["num_hidden_layers"], config["rms_norm_eps"]
        tensors = load_file(str(model_dir / "model.safetensors"))
        prefix = f"model.layers.{num_layers}."
        mtp = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        self.enorm, self.hnorm = mtp.pop("enorm.weight"), mtp.pop("hnorm.weight")
        self.eh_proj = mtp.pop("eh_proj.weight")
        self.embed = tensors["model.embed_tokens.weight"]
        one_layer = {f"model.layers.0.{k}": v for k, v in mtp.items()
                     if not k.startswith(("shared_head.", "embed_tokens."))}  # fmt: skip
        one_layer["model.norm.weight"] = mtp["shared_head.norm.weight"]
        one_layer["model.embed_tokens.weight"] = self.embed
        one_layer["lm_head.weight"] = tensors["lm_head.weight"]
        layer_dir = tmp_path / "mtp-as-a-model"
        layer_dir.mkdir()
        # Layer 0 of one: the MoE layer the MTP layer is (V3 and GLM: past the dense ones).
        small = {**config, "num_hidden_layers": 1, "first_k_dense_replace": 0}
        (layer_dir / "config.json").write_text(json.dumps(small))
        save_file(one_layer, str(layer_dir / "model.safetensors"), metadata={"format": "pt"})
        self.target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.layer = AutoModelForCausalLM.from_pretrained(layer_dir, dtype=torch.float32)

    @staticmethod
    def _after_norm(model, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states after the final norm [n, hidden], logits [n, vocab])."""
        seen = []
        hook = model.model.norm.register_forward_hook(lambda _m, _args, out: seen.append(out))
        try:
            logits = model(**inputs).logits[0]
        finally:
            hook.remove()
        return seen[0][0], logits

    @torch.no_grad()
    def drafts(self, token_ids: list[int], last: int, num_drafts: int) -> list[list[float]]:
        """MTP logits of the drafts after position ``last`` of ``token_ids``: the layer at
        ``last`` (fed ``token_ids[last + 1]``), then at ``last + j`` fed its own state and
        draft j (greedy). One [vocab] row per draft."""
        hidden, _ = self._after_norm(self.target, input_ids=torch.tensor([token_ids[: last + 1]]))
        inputs = self._inputs(torch.tensor(token_ids[1 : last + 2]), hidden)  # positions 0..last
        rows = []
        for _ in range(num_drafts):
            positions = torch.arange(len(inputs))[None]
            states, logits = self._after_norm(
                self.layer, inputs_embeds=inputs[None], position_ids=positions
            )
            rows.append(logits[-1])
            draft = torch.tensor([int(logits[-1].argmax())])
            inputs = torch.cat((inputs, self._inputs(draft, states[-1:])))
        return rows

    def _inputs(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embeds = _rms(self.embed[next_ids], self.enorm, self.eps)
        both = torch.cat((embeds, _rms(hidden, self.hnorm, self.eps)), dim=-1)
        return both @ self.eh_proj.T


def _run_recording_drafts(engine: LLMEngine) -> tuple[dict, dict[str, dict[int, list[int]]]]:
    """Run ``engine`` to the end: its finished outputs by request id, and each request's
    fresh drafts after each step, by the number of tokens they follow."""
    finished, seen = {}, {}
    while engine.has_work():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        for request in engine.scheduler.requests.values():
            if request.current_model_drafts:
                drafts = seen.setdefault(request.request_id, {})
                drafts[request.num_tokens] = list(request.current_model_drafts)
    return finished, seen


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_drafts_equal_the_reference_layer(model_factory, tmp_path, arch):
    """Two drafts after every step of three requests (prompts in 32-token chunks, then
    again over their cached prefixes): each is the reference's greedy draft at the same
    point (rows whose top two logits lie within 1e-3 are skipped as ties)."""
    model_dir = model_factory(arch)
    reference = ReferenceMtp(model_dir, tmp_path)
    prompts = random_prompts((40, 75, 100), seed=11)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    config = EngineConfig(**MTP, num_speculative_tokens=2, max_num_batched_tokens=32)
    engine = LLMEngine(model_dir, config)
    assert checked_drafts(engine, prompts, params, reference.drafts) >= 20
    assert engine.leak_report() == []


def checked_drafts(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    reference: Callable[[list[int], int, int], list[torch.Tensor]],
    token_of: Callable[[torch.Tensor], int] = lambda row: int(row.argmax()),
) -> int:
    """Run ``prompts`` on ``engine`` twice (the second round over their cached prefixes)
    and check every draft after every step against ``reference(tokens, last, n)``'s
    logits rows at the same point (``token_of`` a row: its draft), up to the first row
    whose top two logits lie within 1e-3 (a tie: later drafts follow either choice).
    Returns how many drafts were checked."""
    checked = 0
    for round_ in range(2):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{round_}-{i}", prompt, params)
        outputs, seen = _run_recording_drafts(engine)
        for i, prompt in enumerate(prompts):
            request_id = f"r{round_}-{i}"
            tokens = list(prompt) + list(outputs[request_id].outputs[0].token_ids)
            assert seen.get(request_id), f"{request_id} never drafted"
            for num_tokens, drafts in seen[request_id].items():
                rows = reference(tokens, num_tokens - 2, len(drafts))
                for draft, row in zip(drafts, rows, strict=True):
                    top = row.topk(2).values
                    if top[0] - top[1] < 1e-3:
                        break
                    assert draft == token_of(row), (request_id, num_tokens, drafts)
                    checked += 1
    return checked


def test_the_prompts_mtp_kv_moves_with_its_blocks(model_factory):
    """Prefill on one engine, decode on another: the prefill engine's drafts go with the
    first token, and the decode engine's drafts after every step (and the drafts it
    verifies) equal those of one engine doing both, so the MTP layer's KV of the prompt
    (the last cache layer) came with the blocks."""
    model_dir = model_factory("deepseek_v3")
    config = EngineConfig(**MTP, num_speculative_tokens=2)
    prompts = random_prompts((40, 75, 100), seed=4)
    params = SamplingParams(max_tokens=10, min_tokens=10, temperature=0)
    colocated = LLMEngine(model_dir, config)
    for i, prompt in enumerate(prompts):
        colocated.add_request(f"r{i}", prompt, params)
    _, expected = _run_recording_drafts(colocated)

    puller = LocalPuller()
    prefill = LLMEngine(model_dir, config)
    decode = LLMEngine(model_dir, config, kv_puller=puller)
    puller.sources["prefill-0"], puller.target = prefill, decode
    assert len(prefill.runner.kv_caches) == 5  # 4 layers and the MTP layer's
    # The pool sizing before start (pdserve config check) counts the MTP layer too.
    shape = ModelShape.read(model_dir)
    assert shape.bytes_per_block(16, 4, draft_layer=True) == prefill.runner.bytes_per_block
    assert shape.bytes_per_block(16, 4) * 5 == prefill.runner.bytes_per_block * 4
    firsts = hand_off(prefill, decode, prompts, params)
    _, got = _run_recording_drafts(decode)
    assert puller.num_blocks_pulled > 0
    for i, prompt in enumerate(prompts):
        request_id, after_prefill = f"r{i}", len(prompt) + 1
        # The prefill engine's drafts went out with its first token ...
        assert firsts[request_id].draft_token_ids == expected[request_id][after_prefill]
        # ... to the decode engine, which holds them from the start and from there drafts
        # exactly as one engine doing both.
        assert got[request_id] == expected[request_id]
    assert decode.scheduler.num_draft_tokens == colocated.scheduler.num_draft_tokens
    for i in range(len(prompts)):
        assert prefill.release_kv(f"r{i}")
    for engine in (colocated, prefill, decode):
        assert engine.leak_report() == []


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_right_drafts_are_all_kept_and_save_steps(model_factory, tmp_path, arch):
    """With drafts that are always right, every draft is kept (recursive ones included)
    and the tokens are those of decoding without drafts, in a quarter of the decode
    steps."""
    model_dir = oracle_mtp_checkpoint(model_factory(arch), tmp_path / "oracle")
    prompts = random_prompts((20, 50), seed=2)
    params = SamplingParams(max_tokens=33, min_tokens=33, temperature=0)
    plain = LLM(model_dir, dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(model_dir, **MTP, num_speculative_tokens=3)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    scheduler = llm.engine.scheduler
    # 3 drafts a step (the recursive ones' positions have slots: Scheduler._lookahead).
    assert scheduler.num_draft_tokens == scheduler.num_accepted_tokens == 2 * 8 * 3
    # One step for the prompts, then 4 tokens a step (32 / 4 = 8).
    assert llm.engine.num_steps == 1 + 8
    assert llm.engine.leak_report() == []


def test_a_model_without_an_mtp_layer_is_refused(tiny_llama):
    with pytest.raises(ConfigError, match="has no") as error:
        LLMEngine(tiny_llama, EngineConfig(**MTP, num_speculative_tokens=2))
    assert error.value.key == "engine.speculative_method"


EXPERTS_WHOLE = dict(expert_parallel=True)
REBALANCED = dict(expert_parallel=True, num_redundant_experts=2, expert_rebalance_interval=2)


@pytest.mark.parametrize(
    ("arch", "experts"),
    [("deepseek_v3", {}), ("glm4_moe", {}), ("deepseek_v3", EXPERTS_WHOLE),
     ("deepseek_v3", REBALANCED), ("qwen3_5", {})],
)  # fmt: skip
def test_tensor_parallel_drafts_equal_one_rank(model_factory, tmp_path, arch, experts):
    """Over 2 ranks (the MTP layer's heads and experts split as every layer's, or its
    experts dealt out whole with expert parallelism, and rebalanced with the model's;
    its passes sent to the other rank as ``MtpPass``): the same drafts after every step
    as one process, and the same tokens. Qwen3.5's (``mtp.*``) over a hybrid model, whose
    ranks keep their heads' states after each verified token too."""
    model_dir = model_factory(arch)
    if arch == "qwen3_5":
        model_dir = add_qwen_mtp_layer(model_dir, tmp_path / "with-mtp")
    prompts = random_prompts((30, 70), seed=8)
    params = SamplingParams(max_tokens=10, min_tokens=10, temperature=0)
    recorded = []
    for tp_size in (1, 2):
        config = EngineConfig(**MTP, num_speculative_tokens=2, tensor_parallel_size=tp_size,
                              **(experts if tp_size > 1 else {}),
                              kv_cache_bytes=32 << 20)  # fmt: skip
        engine = LLMEngine(model_dir, config)
        try:
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{i}", prompt, params)
            outputs, drafts = _run_recording_drafts(engine)
            if tp_size > 1 and experts is REBALANCED:  # the MTP layer's experts move too
                shard = engine.runner.shard
                assert shard.moe_layers[-1] is shard.model.model.mtp_layers[0].mlp
                assert engine.runner.expert_balance.num_moved_slots > 0
            assert engine.leak_report() == []
        finally:
            engine.close()
        tokens = {rid: out.outputs[0].token_ids for rid, out in outputs.items()}
        recorded.append((tokens, drafts))
    (one_tokens, one_drafts), (tp_tokens, tp_drafts) = recorded
    assert tp_tokens == one_tokens
    assert tp_drafts == one_drafts and all(one_drafts.values())


def test_a_checkpoint_without_the_layers_tensors_is_refused(model_factory, tmp_path):
    """config.json declares the layer (as transformers' configs do by default) but the
    files lack it: refused with mtp, saying so; served without."""
    model_dir = model_factory("deepseek_v3")
    copy = tmp_path / "no-mtp"
    copy.mkdir()
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            (copy / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(model_dir / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.4.")},
              str(copy / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(ModelLoadError, match="declares 1 MTP layer.*but the files store no"):
        LLMEngine(copy, EngineConfig(**MTP, num_speculative_tokens=2))
    assert LLMEngine(copy, EngineConfig(dtype="float32")).leak_report() == []


def test_both_roles_need_the_same_method():
    """With mtp the KV cache has one more layer, which moves with the blocks."""
    with pytest.raises(ConfigError, match="same speculative_method") as error:
        build(PdserveConfig, {"decode": {"engine": {"speculative_method": "mtp"}}})
    assert error.value.key == "decode.engine.speculative_method"
    config = build(PdserveConfig, {"engine": {"speculative_method": "mtp"}})
    assert {config.engine_for(role).speculative_method for role in Role} == {SpeculativeMethod.MTP}


def test_config_check_refuses_mtp_for_a_model_without_the_layer(
    tiny_llama, model_factory, tmp_path, capsys
):
    """Before anything starts (``pdserve config check``, every entry point's load)."""
    path = tmp_path / "layout.yaml"
    path.write_text("engine: {speculative_method: mtp, num_speculative_tokens: 2}\n")
    assert main(["config", "check", str(path), "--set", f"model={tiny_llama}"]) == 2
    assert "error: engine.speculative_method: mtp needs" in capsys.readouterr().err
    model = model_factory("glm4_moe")
    assert main(["config", "check", str(path), "--set", f"model={model}"]) == 0


def test_drafts_handed_to_add_request(model_factory, tiny_llama):
    """A decode worker takes the prefill worker's drafts for its first step: ids outside
    the vocabulary are dropped (a wrong id can cost a rejected draft, never an error), and
    an engine without MTP ignores them."""
    model_dir = model_factory("deepseek_v3")
    engine = LLMEngine(model_dir, EngineConfig(**MTP, num_speculative_tokens=2))
    vocab = engine.arch.vocab_size
    params = SamplingParams(max_tokens=4, temperature=0)
    request = engine.add_request("r", [5, 6, 7], params, output_token_ids=[8],
                                 draft_token_ids=[vocab + 3, 9, -1, 10])  # fmt: skip
    assert (request.model_draft_ids, request.model_drafts_after) == ([9, 10], 4)
    plain = LLMEngine(tiny_llama, EngineConfig(num_speculative_tokens=2))
    other = plain.add_request("r", [5, 6, 7], params, output_token_ids=[8], draft_token_ids=[9])
    assert other.model_draft_ids == []
    for each in (engine, plain):
        each.abort_request("r")
        assert each.leak_report() == []

"""LoRA adapters: greedy parity with transformers + peft on the same files, mixed batches,
prefix-cache isolation per adapter, and clear refusals of what is not supported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine_config import EngineConfig
from common.hashing import hash_blocks, prefix_salt
from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.models.arch import ModelLoadError, read_arch_config
from engine.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_lora_adapter
from engine.models.lora_maker import make_lora_adapter
from tests.engine.helpers import hf_greedy, random_prompts

NUM_TOKENS = 24
PROMPT_LENGTHS = (5, 17, 40, 71)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per architecture: one adapter on every projection, one on some (q, v, down) with
    rsLoRA scaling and another rank."""
    made: dict[str, dict[str, Path]] = {}

    def make(model_dir: Path, arch: str) -> dict[str, Path]:
        if arch not in made:
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            made[arch] = {
                "all": make_lora_adapter(model_dir, root / "all", rank=8, seed=1),
                "some": make_lora_adapter(
                    model_dir,
                    root / "some",
                    rank=4,
                    alpha=4.0,
                    use_rslora=True,
                    seed=2,
                    targets=("q_proj", "v_proj", "down_proj"),
                ),
            }
        return made[arch]

    return make


# qwen2: q/k/v biases, tied embeddings; qwen2_moe: experts and a shared expert, whose
# MLPs take no adapter (so "all" adapts the attention, and "some" only q and v); gemma3:
# GeGLU, norms around each block; phi3: adapters of its fused qkv_proj and gate_up_proj;
# qwen3_5: linear-attention layers' in_proj_* and out_proj, gated attention's q_proj.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe", "gemma3", "phi3", "qwen3_5"])
def test_greedy_parity_with_peft_in_one_mixed_batch(model_factory, adapters, arch):
    model_dir = model_factory(arch)
    paths = adapters(model_dir, arch)
    prompts = random_prompts(PROMPT_LENGTHS)
    llm = LLM(model_dir, lora_adapters=paths, dtype="float32")
    # Base and both adapters for every prompt, all in the same steps.
    names = [None, "all", "some"]
    outputs = llm.generate(
        [p for _ in names for p in prompts],
        GREEDY,
        use_tqdm=False,
        lora_name=[name for name in names for _ in prompts],
    )
    tokens = [o.outputs[0].token_ids for o in outputs]
    n = len(prompts)
    expected = hf_greedy(model_dir, prompts, NUM_TOKENS)
    for name in ("all", "some"):
        expected += hf_greedy(model_dir, prompts, NUM_TOKENS, adapter_dir=paths[name])
    for i, (got, reference) in enumerate(zip(tokens, expected, strict=True)):
        assert got == reference, f"{names[i // n]}, prompt of {len(prompts[i % n])} tokens"
    # The adapters change the model (else parity would prove nothing).
    for k in (1, 2):
        assert sum(tokens[i] != tokens[k * n + i] for i in range(n)) >= n - 1
    assert llm.engine.leak_report() == []


def test_adapter_alone_equals_adapter_in_a_mixed_batch(tiny_llama, adapters):
    paths = adapters(tiny_llama, "llama")
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    alone = LLM(tiny_llama, lora_adapters=paths).generate(
        prompts, GREEDY, use_tqdm=False, lora_name="some"
    )
    llm = LLM(tiny_llama, lora_adapters=paths)
    mixed = llm.generate(
        [p for p in prompts for _ in range(2)],
        GREEDY,
        use_tqdm=False,
        lora_name=["some", "all"] * len(prompts),
    )
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in mixed[0::2]]
    assert llm.engine.leak_report() == []


def test_prefix_cache_is_kept_apart_per_adapter(tiny_llama, adapters):
    paths = adapters(tiny_llama, "llama")
    prompt = random_prompts((70,), seed=5)[0]  # 4 full blocks of 16
    fresh = {
        name: LLM(tiny_llama, lora_adapters=paths).generate(
            [prompt], GREEDY, use_tqdm=False, lora_name=name
        )[0]
        for name in (None, "all")
    }
    llm = LLM(tiny_llama, lora_adapters=paths)
    runs = []
    for name in (None, "all", "all", None, "some"):
        runs.append(llm.generate([prompt], GREEDY, use_tqdm=False, lora_name=name)[0])
    cached = [run.num_cached_tokens for run in runs]
    # Each adapter's first run computes the prompt; a repeat of the same adapter hits.
    assert cached == [0, 0, 64, 64, 0]
    assert runs[1].outputs[0].token_ids == fresh["all"].outputs[0].token_ids
    assert runs[3].outputs[0].token_ids == fresh[None].outputs[0].token_ids
    assert llm.engine.leak_report() == []


def test_prefix_salt_separates_adapters_and_tenants():
    tokens = list(range(64))
    hashes = {
        (salt, lora): tuple(hash_blocks(tokens, 16, prefix_salt(salt, lora)))
        for salt in (None, "tenant")
        for lora in (None, "a", "b")
    }
    assert len(set(hashes.values())) == len(hashes)
    # Without an adapter the salt is the tenant's own: base-model hashes do not move.
    assert prefix_salt("tenant", None) == "tenant"
    assert hashes[(None, None)] == tuple(hash_blocks(tokens, 16))
    # No cache_salt string reaches an adapter's salt (its bytes are never UTF-8).
    forged = prefix_salt(None, "a")
    with pytest.raises(UnicodeDecodeError):
        forged.decode()


def test_unknown_adapter_is_refused_and_leaves_the_engine_clean(tiny_llama, adapters):
    llm = LLM(tiny_llama, lora_adapters=adapters(tiny_llama, "llama"))
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'.*all, some"):
        llm.engine.add_request("r", [5, 6, 7], GREEDY, lora_name="nope")
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'"):
        llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False, lora_name=[None, "nope"])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.leak_report() == []


def test_adapters_load_and_unload_at_runtime(tiny_llama, adapters):
    paths = adapters(tiny_llama, "llama")
    prompt = random_prompts((70,), seed=6)[0]  # 4 full blocks of 16
    fresh = LLM(tiny_llama, lora_adapters=paths)
    expected = {
        name: fresh.generate([prompt], GREEDY, use_tqdm=False, lora_name=name)[0]
        .outputs[0].token_ids
        for name in ("all", "some")
    }  # fmt: skip
    assert expected["all"] != expected["some"]
    llm = LLM(tiny_llama)

    def run(name: str):
        return llm.generate([prompt], GREEDY, use_tqdm=False, lora_name=name)[0]

    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'x'"):
        run("x")
    assert llm.load_lora_adapter("x", paths["all"]) is True
    assert llm.load_lora_adapter("x", paths["all"]) is False  # the same files: a no-op
    first = run("x")
    assert first.outputs[0].token_ids == expected["all"] and first.num_cached_tokens == 0
    with pytest.raises(InvalidRequestError, match="'x' is loaded with other weights"):
        llm.load_lora_adapter("x", paths["some"])
    assert llm.unload_lora_adapter("x") is True
    assert llm.unload_lora_adapter("x") is False
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'x'"):
        run("x")
    # Other weights under the old name: its cached blocks are the old weights' KV and
    # must not be hit (the cache is keyed by weights, not by name).
    llm.load_lora_adapter("x", paths["some"])
    other = run("x")
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids == expected["some"]
    # The first files again: their KV is still cached, and is theirs.
    llm.unload_lora_adapter("x")
    llm.load_lora_adapter("x", paths["all"])
    again = run("x")
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == expected["all"]
    assert llm.engine.leak_report() == []


def test_an_adapter_unloaded_mid_request_serves_that_request_to_its_end(tiny_llama, adapters):
    paths = adapters(tiny_llama, "llama")
    prompts = random_prompts((30, 9), seed=7)
    expected = LLM(tiny_llama, lora_adapters=paths).generate(
        prompts, GREEDY, use_tqdm=False, lora_name="all"
    )
    llm = LLM(tiny_llama, lora_adapters=paths)
    engine = llm.engine
    engine.add_request("a", prompts[0], GREEDY, lora_name="all")
    for _ in range(3):
        engine.step()
    assert engine.unload_lora_adapter("all")
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'all'"):
        engine.add_request("b", prompts[1], GREEDY, lora_name="all")
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outputs["a"].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert sorted(engine.runner.lora_adapters) == ["some"]
    assert engine.leak_report() == []


def test_a_pull_computed_with_an_adapters_old_files_is_refused_after_a_reload(tiny_llama, adapters):
    """The prefill worker computed the prompt with ``alice``'s first files; the decode
    worker had ``alice`` unloaded and loaded with other files meanwhile (another router,
    an operator). By name alone it decoded the first files' KV with the second's weights
    and cached it under their key, for every later request of the new files. The request
    names the files it was placed for: refused, and nothing leaked."""
    from engine.request import RemoteKV
    from tests.engine.local_puller import LocalPuller

    paths = adapters(tiny_llama, "llama")
    puller = LocalPuller()
    prefill = LLMEngine(tiny_llama, EngineConfig(), lora_adapters={"alice": paths["all"]})
    decode = LLMEngine(tiny_llama, EngineConfig(), kv_puller=puller,
                       lora_adapters={"alice": paths["all"]})  # fmt: skip
    puller.sources["prefill-0"], puller.target = prefill, decode
    placed = decode.lora_adapter("alice").fingerprint
    prompt = random_prompts((40,), seed=8)[0]
    prefill.add_request("r", prompt, GREEDY, prefill_only=True, lora_name="alice",
                        lora_fingerprint=placed)  # fmt: skip
    while prefill.has_unfinished_requests():
        (first,) = [o for o in prefill.step() if o.finished] or [None]
    assert decode.unload_lora_adapter("alice")
    assert decode.add_lora_adapter(decode.read_lora_adapter("alice", paths["some"]))
    remote = RemoteKV("l0", len(prompt), tuple(first.kv_block_ids), "prefill-0")
    with pytest.raises(InvalidRequestError, match="loaded again with other files"):
        decode.add_request("r", prompt, GREEDY, remote_kv=remote, lora_name="alice",
                           lora_fingerprint=placed,
                           output_token_ids=first.outputs[0].token_ids)  # fmt: skip
    now = decode.lora_adapter("alice").fingerprint
    decode.add_request("s", prompt, GREEDY, lora_name="alice", lora_fingerprint=now)
    while decode.has_unfinished_requests():
        decode.step()
    assert prefill.release_kv("r")
    assert prefill.leak_report() == [] and decode.leak_report() == []


def test_bad_runtime_loads_are_refused_and_change_nothing(tiny_llama, adapters, tmp_path):
    paths = adapters(tiny_llama, "llama")
    llm = LLM(tiny_llama, lora_adapters={"all": paths["all"]})
    with pytest.raises(InvalidRequestError, match="no adapter_config.json") as missing:
        llm.load_lora_adapter("y", tmp_path)
    assert missing.value.param == "lora_path"
    corrupt = _copy_adapter(paths["some"], tmp_path / "corrupt")
    (corrupt / ADAPTER_WEIGHTS).write_bytes(b"\x10" + bytes(7) + b"{not a header}")
    with pytest.raises(InvalidRequestError, match="corrupt") as bad:
        llm.load_lora_adapter("y", corrupt)
    assert bad.value.param == "lora_path"
    adapter = llm.engine.read_lora_adapter("y", paths["some"])
    with pytest.raises(InvalidRequestError, match="1 LoRA adapters are loaded"):
        llm.engine.add_lora_adapter(adapter, max_adapters=1)
    assert sorted(llm.engine.runner.lora_adapters) == ["all"]
    assert llm.engine.add_lora_adapter(adapter, max_adapters=2) is True


def _copy_adapter(source: Path, target: Path, config_changes=None, tensors=None) -> Path:
    target.mkdir()
    config = json.loads((source / ADAPTER_CONFIG).read_text())
    config.update(config_changes or {})
    (target / ADAPTER_CONFIG).write_text(json.dumps(config))
    weights = load_file(str(source / ADAPTER_WEIGHTS))
    save_file(tensors(weights) if tensors else weights, str(target / ADAPTER_WEIGHTS))
    return target


_LAYER0_Q = "base_model.model.model.layers.0.self_attn.q_proj"
_LAYER0_QKV = "base_model.model.model.layers.0.self_attn.qkv_proj"  # Phi-3's fused module


@pytest.mark.parametrize(
    ("config_changes", "tensors", "message"),
    [
        ({"use_dora": True}, None, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"alpha_pattern": {"q_proj": 32}}, None, "alpha_pattern"),
        ({"peft_type": "IA3"}, None, "peft_type"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, None, "embed_tokens"),
        ({"r": 64}, None, "has rank 8; adapter_config.json says r=64"),
        ({"r": 0, "lora_alpha": 0}, None, "says r=0"),
        (None, lambda w: {k: v for k, v in w.items() if k != f"{_LAYER0_Q}.lora_B.weight"},
         "lacks lora_A or lora_B"),
        (None, lambda w: {**w, f"{_LAYER0_Q}.lora_A.weight": torch.zeros(8, 100)},
         r"this model needs \[r, 256\]"),
        (None, lambda w: {**w, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 256)},
         "unsupported tensor"),
        (None, lambda w: {k.replace("layers.0.", "layers.9."): v for k, v in w.items()},
         "names layer 9 of 4"),
        (None, lambda w: {**w, f"{_LAYER0_QKV}.lora_A.weight": torch.zeros(8, 256),
                          f"{_LAYER0_QKV}.lora_B.weight": torch.zeros(512, 8)},
         "layer 0 adapts qkv_proj and its parts"),
    ],
)  # fmt: skip
def test_unsupported_or_mismatched_adapters_are_refused(
    tiny_llama, adapters, tmp_path, config_changes, tensors, message
):
    source = adapters(tiny_llama, "llama")["all"]
    bad = _copy_adapter(source, tmp_path / "bad", config_changes, tensors)
    arch = read_arch_config(tiny_llama)
    with pytest.raises(ModelLoadError, match=message):
        load_lora_adapter("bad", bad, arch, torch.device("cpu"), torch.float32)


def test_a_directory_without_an_adapter_is_refused(tiny_llama, tmp_path):
    arch = read_arch_config(tiny_llama)
    with pytest.raises(ModelLoadError, match="no adapter_config.json"):
        load_lora_adapter("x", tmp_path, arch, torch.device("cpu"), torch.float32)


def test_adapters_on_expert_layers_are_refused(model_factory, adapters, tmp_path):
    model_dir = model_factory("qwen3_moe")
    source = adapters(model_dir, "qwen3_moe")["all"]
    written = load_file(str(source / ADAPTER_WEIGHTS))
    assert written and all(".self_attn." in key for key in written)  # the maker skipped MLPs
    arch = read_arch_config(model_dir)
    mlp = "base_model.model.model.layers.1.mlp"
    cases = {
        f"{mlp}.down_proj": ("mixture-of-experts layer", (8, 256), (256, 8)),
        f"{mlp}.experts.3.down_proj": ("LoRA on mixture-of-experts MLPs", (8, 256), (256, 8)),
        f"{mlp}.shared_expert.up_proj": ("LoRA on mixture-of-experts MLPs", (8, 256), (512, 8)),
    }
    for case, (key, (message, a_shape, b_shape)) in enumerate(cases.items()):
        bad = _copy_adapter(
            source,
            tmp_path / f"bad-{case}",
            tensors=lambda w, key=key, a=a_shape, b=b_shape: {
                **w, f"{key}.lora_A.weight": torch.zeros(a), f"{key}.lora_B.weight": torch.zeros(b)
            },
        )  # fmt: skip
        with pytest.raises(ModelLoadError, match=message):
            load_lora_adapter("bad", bad, arch, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(
    "targets",
    [("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"), ("in_proj_z", "q_proj")],
)
def test_a_hybrid_models_adapters_give_peft_log_probs(model_factory, tmp_path, targets):
    """Qwen3.5: adapters of the linear-attention layers' four input projections (one
    fused ``in_proj`` here) and output projection, or of one of them beside the gated
    attention's q_proj (each head's query and gate rows): every prompt position's
    log-probs equal transformers + peft's (its tiny model's greedy tokens barely depend
    on the linear-attention layers; the log-probs do), and differ from the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = model_factory("qwen3_5")
    adapter = make_lora_adapter(model_dir, tmp_path / "a", seed=3, targets=targets)
    prompt = random_prompts([40], seed=4)[0]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        unadapted = base(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
        model = PeftModel.from_pretrained(base, str(adapter))
        reference = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    assert (reference - unadapted).abs().max() > 0.5  # the adapter changes the model
    llm = LLM(model_dir, dtype="float32", lora_adapters={"a": adapter}, prefill_chunk_tokens=15)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5)
    (output,) = llm.generate([prompt], params, use_tqdm=False, lora_name=["a"])
    for position, lp in enumerate(output.prompt_logprobs[1:]):
        expected = reference[position]
        assert lp.logprob == pytest.approx(expected[lp.token_id].item(), abs=1e-4), position
        assert list(lp.top_logprobs) == pytest.approx(expected.topk(5).values.tolist(), abs=1e-4)
    assert llm.engine.leak_report() == []


def test_a_hybrid_models_adapter_must_name_its_layers_modules(model_factory, adapters, tmp_path):
    """A linear-attention layer has no q_proj, a full-attention one no in_proj_z: an
    adapter naming one is refused (PEFT never writes one)."""
    model_dir = model_factory("qwen3_5")
    arch = read_arch_config(model_dir)
    kinds = arch.linear_attention.layers
    linear, full = kinds.index(True), kinds.index(False)
    source = adapters(model_dir, "qwen3_5")["all"]
    prefix = "base_model.model.model.layers"
    cases = {
        f"{prefix}.{linear}.self_attn.q_proj": rf"{linear} \(linear-attention\) has no self_attn",
        f"{prefix}.{full}.linear_attn.in_proj_z": rf"{full} \(full-attention\) has no linear_attn",
    }
    zeros = {"lora_A": torch.zeros(8, arch.hidden_size), "lora_B": torch.zeros(16, 8)}
    for case, (key, message) in enumerate(cases.items()):
        bad = _copy_adapter(
            source,
            tmp_path / f"bad-{case}",
            tensors=lambda w, key=key: {**w, **{f"{key}.{n}.weight": t for n, t in zeros.items()}},
        )
        with pytest.raises(ModelLoadError, match=message):
            load_lora_adapter("bad", bad, arch, torch.device("cpu"), torch.float32)


def test_target_modules_given_as_full_paths_load_as_peft_reads_them(tiny_llama, adapters, tmp_path):
    """PEFT matches ``target_modules`` by suffix: an adapter trained on chosen layers
    names their full paths. Refused before ("not supported"); now the same tokens as
    transformers + peft."""
    source = adapters(tiny_llama, "llama")["all"]
    chosen = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj")
    adapter = _copy_adapter(
        source,
        tmp_path / "chosen",
        {"target_modules": list(chosen)},
        lambda w: {k: v for k, v in w.items() if k.startswith(tuple(f"base_model.model.{m}."
                                                                    for m in chosen))},
    )  # fmt: skip
    assert len(load_file(str(adapter / ADAPTER_WEIGHTS))) == 4
    prompts = random_prompts(PROMPT_LENGTHS[:2])
    llm = LLM(tiny_llama, lora_adapters={"chosen": adapter}, dtype="float32")
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_name="chosen")
    expected = hf_greedy(tiny_llama, prompts, NUM_TOKENS, adapter_dir=adapter)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert expected != hf_greedy(tiny_llama, prompts, NUM_TOKENS)  # the adapter matters
    assert llm.engine.leak_report() == []


def test_qwen3_nexts_adapters_name_only_modules_it_has(model_factory, tmp_path):
    """Qwen3-Next's linear-attention layers hold in_proj_qkvz and in_proj_ba, not Qwen3.5's
    four input projections: the maker wrote those names for it (PEFT cannot load such an
    adapter) and the loader applied them. The maker now adapts what it has, which PEFT
    loads, and an adapter of Qwen3.5's names is refused."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = model_factory("qwen3_next")
    arch = read_arch_config(model_dir)
    adapter = make_lora_adapter(model_dir, tmp_path / "made", seed=3)
    written = load_file(str(adapter / ADAPTER_WEIGHTS))
    assert written and not any(".in_proj_" in key for key in written)
    assert any(".linear_attn.out_proj." in key for key in written)
    prompt = random_prompts([24], seed=4)[0]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model = PeftModel.from_pretrained(base, str(adapter))
        reference = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    llm = LLM(model_dir, dtype="float32", lora_adapters={"a": adapter})
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    (output,) = llm.generate([prompt], params, use_tqdm=False, lora_name=["a"])
    for position, lp in enumerate(output.prompt_logprobs[1:]):
        assert lp.logprob == pytest.approx(reference[position][lp.token_id].item(), abs=1e-4)
    assert llm.engine.leak_report() == []
    linear = arch.linear_attention.layers.index(True)
    key = f"base_model.model.model.layers.{linear}.linear_attn.in_proj_z"
    zeros = {"lora_A": torch.zeros(8, arch.hidden_size), "lora_B": torch.zeros(16, 8)}
    bad = _copy_adapter(
        adapter, tmp_path / "bad", tensors=lambda w: {**w, **{f"{key}.{n}.weight": t
                                                              for n, t in zeros.items()}}
    )  # fmt: skip
    with pytest.raises(ModelLoadError, match=rf"layer {linear} .* has no linear_attn.in_proj_z"):
        load_lora_adapter("bad", bad, arch, torch.device("cpu"), torch.float32)

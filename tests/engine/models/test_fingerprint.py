"""The weights fingerprint that keys stored KV: equal for copies of one checkpoint,
different after the weights change under the same directory name and config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.engine_config import StateDType
from engine.models.arch import read_arch_config
from engine.models.fingerprint import weights_fingerprint
from engine.models.lora import load_lora_adapter
from worker.runtime import model_namespace


def test_copies_agree_and_new_weights_under_the_same_name_and_config_do_not(tiny_llama, tmp_path):
    copy = tmp_path / "copy" / tiny_llama.name  # another host's copy: new path, new mtimes
    shutil.copytree(tiny_llama, copy, copy_function=shutil.copyfile)
    assert model_namespace(copy) == model_namespace(tiny_llama)

    tuned = tmp_path / "tuned" / tiny_llama.name  # a fine-tune saved over the same name
    shutil.copytree(tiny_llama, tuned)
    path = tuned / "model.safetensors"
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    generator = torch.Generator().manual_seed(0)
    for tensor in tensors.values():
        tensor += 1e-3 * torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
    save_file(tensors, path, metadata=metadata)
    assert (tuned / "config.json").read_bytes() == (tiny_llama / "config.json").read_bytes()
    assert weights_fingerprint(tuned) != weights_fingerprint(tiny_llama)
    assert model_namespace(tuned) != model_namespace(tiny_llama)


def test_a_change_to_one_tensor_alone_changes_it(tiny_llama, tmp_path):
    """A merged LoRA adapter or a re-quantised layer rewrites some tensors only: every
    tensor is sampled, so any one of them rewritten changes the fingerprint."""
    with safe_open(tiny_llama / "model.safetensors", "pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    base = weights_fingerprint(tiny_llama)
    names = sorted(tensors)
    for name in (names[len(names) // 3], names[len(names) // 2], names[-2]):
        changed = tmp_path / name / tiny_llama.name
        shutil.copytree(tiny_llama, changed)
        edited = dict(tensors)
        edited[name] = tensors[name] * 1.01 + 1e-3
        save_file(edited, changed / "model.safetensors", metadata=metadata)
        assert weights_fingerprint(changed) != base, name


def test_an_adapters_kv_key_follows_its_weights_not_its_path(tiny_llama, tmp_path):
    """Adapters' blocks are keyed by name and weights (``LoraAdapter.key``): one changed
    under its name must not read the blocks its old weights computed, in any worker's
    cache or the shared store; a copy of the same files may."""
    from common.hashing import prefix_salt
    from engine.models.lora_maker import make_lora_adapter

    adapter = make_lora_adapter(tiny_llama, tmp_path / "a", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(adapter, copy, copy_function=shutil.copyfile)
    retrained = make_lora_adapter(tiny_llama, tmp_path / "b", seed=2)
    arch = read_arch_config(tiny_llama)

    def key(name: str, path: Path) -> str:
        return load_lora_adapter(name, path, arch, torch.device("cpu"), torch.float32).key

    assert key("alice", copy) == key("alice", adapter)
    assert key("alice", retrained) != key("alice", adapter)
    assert key("bob", adapter) != key("alice", adapter)
    assert prefix_salt(None, key("alice", retrained)) != prefix_salt(None, key("alice", adapter))


def test_image_preprocessing_and_a_16_bit_state_dtype_get_their_own_namespace(tiny_llama, tmp_path):
    """Two keys the KV layout does not carry. An image's blocks are keyed by its encoded
    bytes: a new preprocessor config (another size or normalisation) computes other KV
    under the same key. A hybrid model's state files are raw states in the configured
    dtype: a bfloat16 deployment read the float32 files an earlier one left (NaN
    log-probs, no error)."""
    base = model_namespace(tiny_llama)
    assert model_namespace(tiny_llama, StateDType.FLOAT32) == base
    named = {model_namespace(tiny_llama, dtype) for dtype in StateDType}
    assert len(named) == len(StateDType)
    vision = tmp_path / "vision" / tiny_llama.name
    shutil.copytree(tiny_llama, vision)
    fingerprints = set()
    for size in (224, 448):
        (vision / "preprocessor_config.json").write_text(json.dumps({"size": size}))
        fingerprints.add(weights_fingerprint(vision))
    assert len(fingerprints) == 2 and weights_fingerprint(tiny_llama) not in fingerprints


def test_fp8_blocks_in_shared_storage_are_kept_apart_by_the_dtype_that_computed_them(tiny_llama):
    """A float32 and a bfloat16 deployment with an fp8 cache under one directory read each
    other's blocks (a quarter of the second's replies changed, no error): where the KV
    cache rounds what the model computes, the directory names the dtype that computed it."""
    from common.engine_config import DType, EngineConfig, KVCacheDType
    from worker.runtime import kv_namespace

    base = model_namespace(tiny_llama)
    assert kv_namespace(EngineConfig(), tiny_llama) == base  # (the KV dtype says it)
    named = {
        kv_namespace(EngineConfig(dtype=dtype, kv_cache_dtype=KVCacheDType.FP8), tiny_llama)
        for dtype in (DType.FLOAT32, DType.BFLOAT16, DType.AUTO)  # (auto: float32 on a CPU)
    }
    assert named == {f"{base}-computed-float32", f"{base}-computed-bfloat16"}

"""The weights fingerprint that keys stored KV: equal for copies of one checkpoint,
different after the weights change under the same directory name and config."""

from __future__ import annotations

import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.models.fingerprint import weights_fingerprint
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

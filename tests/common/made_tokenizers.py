"""Small tokenizers of two real families, trained here in milliseconds, for what the demo
model's tokenizer (byte-level, no merges across characters) cannot show:

- ``llama2_style``: SentencePiece-style BPE (Llama 2, Mistral v0.x): words start with
  "▁", bytes outside the vocabulary fall back to ``<0xNN>`` tokens, and the decoder
  strips the space of a sequence's first token.
- ``byte_level``: GPT-2-style byte-level BPE whose merges join a whole character with
  part of the next (" " and two of the em dash's three bytes: "ĠâĢ").
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer

from common.tokenizer import Tokenizer

_SPECIAL = ["<unk>", "<s>", "</s>"]


def _save(rust: RustTokenizer, path: Path) -> Tokenizer:
    path.mkdir(parents=True, exist_ok=True)
    rust.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(path)


def llama2_style(path: Path) -> Tokenizer:
    corpus = ["Hello world, this is the test.", "The quick brown fox jumps over the dog."] * 20
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = RustTokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200,
                                                            special_tokens=_SPECIAL))  # fmt: skip
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):  # the byte-fallback tokens
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    rust = RustTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    rust.normalizer = normalizer
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                      decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    rust.add_special_tokens([AddedToken(t, special=True) for t in _SPECIAL])
    return _save(rust, path)


def byte_level(path: Path) -> Tokenizer:
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    rust.train_from_iterator(["a — b — c — d"] * 50, trainer)
    return _save(rust, path)

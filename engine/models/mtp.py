"""DeepSeek-V3's multi-token-prediction (MTP) layer, GLM-4.5's too: a draft model the
checkpoint ships, stored as one more decoder layer after the ``num_hidden_layers`` the
model runs (V3's ``model.layers.61``).

At position ``q`` it reads the target model's hidden state there (``h_q``, after the final
norm) and the embedding of the token after it (``t_{q+1}``), and predicts ``t_{q+2}``:

    x = eh_proj([enorm(embed(t_{q+1})), hnorm(h_q)])     # [n, 2 * hidden] -> [n, hidden]
    h'_q = shared_head.norm(decoder_layer(x))            # attention over its own KV cache
    logits = lm_head(h'_q)

So one MTP pass after a step, over the positions whose next token is now known, yields
each sequence's first draft; further drafts feed the layer its own output ``h'`` (after
its norm, as the target's) and its last draft (``engine/mtp_drafts.py``). Both states are
taken after a norm because that is what the layer was trained on: DeepSeek's modeling
code shipped with its checkpoints hands the MTP layer the main model's output after
``model.norm``, and vLLM and SGLang feed and carry normed states (vLLM and AMD's ATOM
once carried pre-norm ones and lost acceptance, never tokens: the target verifies every
draft).
The layer attends over a KV cache of its own, one more cache layer with the same block
ids, so its KV moves with the prompt's blocks.

The checkpoint also stores the layer's ``embed_tokens`` and ``shared_head.head``: copies of
the model's embeddings and LM head in DeepSeek's and GLM's releases, so the model's own are
used and the copies are not loaded (vLLM loads them; they would double the vocabulary's
memory). Unlike vLLM, position 0's token embedding is not zeroed: DeepSeek-V3's report
feeds every position's embedding, and drafts only ever change speed.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.models.arch import ModelArchConfig
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from engine.models.norms import rms_norm
from engine.models.rope import RotaryEmbedding
from engine.parallel.group import TPGroup

# Stored per MTP layer, but the model's own tensors serve them (module docstring).
SHARED_WITH_MODEL = ("embed_tokens.weight", "shared_head.head.weight")


class SharedHead(nn.Module):
    """The norm before the (shared) LM head; named as the checkpoint stores it."""

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.norm = rms_norm(arch, arch.hidden_size)


class MtpLayer(DecoderLayer):
    """A decoder layer (``layer_idx`` = ``num_layers + i``: dense or sparse, windowed or
    not, as the arch's per-layer tuples say) with the MTP inputs and head norm."""

    # It reads the target's last states only (an EAGLE-3 head reads some layers' inputs).
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(
        self,
        arch: ModelArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        group: TPGroup,
    ) -> None:
        super().__init__(arch, layer_idx, rotary, backend, group)
        self.enorm = rms_norm(arch, arch.hidden_size)
        self.hnorm = rms_norm(arch, arch.hidden_size)
        self.eh_proj = nn.Linear(2 * arch.hidden_size, arch.hidden_size, bias=False)
        self.shared_head = SharedHead(arch)

    def predict(
        self,
        positions: torch.Tensor,  # [n]
        token_embeds: torch.Tensor,  # [n, hidden]: the tokens after each position
        previous_hidden: torch.Tensor,  # [n, hidden]: the target's (or this layer's) states
        kv_cache: torch.Tensor,  # this layer's [num_blocks, 2, block_size, Hkv, D]
        attn_metadata: object,
    ) -> torch.Tensor:  # [n, hidden], before shared_head.norm
        both = torch.cat((self.enorm(token_embeds), self.hnorm(previous_hidden)), dim=-1)
        return self.forward(positions, self.eh_proj(both), kv_cache, attn_metadata)

    def features(self, hidden: torch.Tensor, aux_states: list[torch.Tensor]) -> torch.Tensor:
        """What its first pass after a step reads of the target ([n, hidden]): the
        target's states after the final norm (``hidden``)."""
        return hidden

    def carried(self, hidden: torch.Tensor) -> torch.Tensor:
        """What its next pass reads of this one's states ([n, hidden]): after its norm."""
        return self.shared_head.norm(hidden)

    def draft_hidden(
        self,
        model: LlamaForCausalLM,
        input_ids: torch.Tensor,  # [n]: t_{q+1} for each position q
        positions: torch.Tensor,  # [n]: q
        previous_hidden: torch.Tensor,  # [n, hidden]
        kv_cache: torch.Tensor,
        attn_metadata: object,
    ) -> torch.Tensor:  # [n, hidden]
        embeds = model.model.embed_tokens(input_ids)
        return self.predict(positions, embeds, previous_hidden, kv_cache, attn_metadata)

    def draft_logits(self, model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """[n, vocab] float32 logits of the layer's states (its norm, the model's head)."""
        return model.compute_logits(self.shared_head.norm(hidden))


def add_mtp_layer(model: LlamaForCausalLM, backend: AttentionBackend, group: TPGroup) -> None:
    """Give ``model`` its first MTP layer (``model.mtp_layers.0``; the loader fills it from
    the checkpoint's ``model.layers.{num_layers}``). Call on the meta device, as the model
    is built."""
    arch = model.arch
    index = arch.num_layers
    rotary = model.rotary_of(index)
    model.model.mtp_layers.append(MtpLayer(arch, index, rotary, backend, group))

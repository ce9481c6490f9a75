"""The assistant's draft graph: k unrolled steps of Gemma-4's MTP assistant over the target's KV cache.

Gemma-4's assistant (transformers' `Gemma4AssistantForCausalLM`) drafts the tokens after a row's
last token from the target's state alone: it keeps no KV of its own, and each of its layers
attends over the KV the target already wrote, that of the target's last sliding-attention layer or
its last full-attention layer by the layer's type (the layers HF's `kv_sharing_modes` marks
"store": the target's `shared_kv_states`). Its input is the target's (scaled) embedding of the last
token beside the target's final hidden state at the position before it (post-norm: what the
target's lm_head reads, HF's `hidden_states[-1]`), projected down (`pre_projection`); every draft
step runs at the last token's position, and its projected output (`post_projection`) stands in for
the target's hidden state at the next step. This is HF's `SinglePositionMultiTokenCandidateGenerator`
(generation/candidate_generator.py), one row at a time there, every row of the batch here.

What a step attends to, as HF's masks give it (`Gemma4AssistantForCausalLM.create_attention_masks`,
with the target's KV of the positions before the last token's): in a full-attention layer every
position before the last token's, 0..p-1; in a sliding layer the `sliding_window` + 1 positions
before it, p-W-1..p-1 (HF's bidirectional window counts the distance inclusively). So a sliding
ring read by the draft must hold W + 1 positions before the query: `Draft` refuses a cache whose
ring is shorter (the window-long ring of `cache_layout` holds W, the query's own slot among them).
The masks follow from each row's position alone (`cache.ring_positions` of p - 1), so the rows of
a batch sit at different positions and the slots the target wrote at p or after (a verify graph's
rejected drafts) are never read.

  Draft  (last_ids [B], hidden [B, H], positions [B]) -> tokens [B, k] int64, logits [B, k, V] fp32
         (ids and positions also as [B, 1], as the decode graph takes them)
         last_ids: each row's last token (at `positions`, its KV not yet written); hidden: the
         target's final hidden state at position - 1; tokens: the greedy drafts; logits: the
         assistant's, from which each draft came (no softcapping: HF's assistant applies none).

The graph reads the cache and writes nothing: no state among its outputs, shapes fixed by B and k,
no data-dependent op.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import Gemma4AssistantForCausalLM

from ..checkpoint import CheckpointError
from ..hub import read_assistant_config
from .cache import SLIDING, KVCache, decode_mask


def shared_layers(config) -> dict[str, int]:
    """Per layer type, the target layer whose KV the assistant reads: the last layer of that type that
    computes its own KV (`kv_sharing_modes`' "store"; with no KV-shared layers, the last of the type)."""
    modes = config.kv_sharing_modes
    return {kind: i for i, kind in enumerate(config.layer_types) if modes[i] == "store"}


def draft_masks(positions: torch.Tensor, cache: KVCache, layers: dict[str, int], window: int, dtype) -> dict:
    """Per layer type, the additive mask [B, 1, 1, ring] of what a draft query at `positions` [B]
    reads of the layer's ring: positions 0..p-1, and in a sliding layer only p-W-1..p-1, which is
    what a decode query at p - 1 with a window of W + 1 sees (`cache.decode_mask`)."""
    return {
        kind: decode_mask(
            (positions - 1).reshape(-1, 1), cache.layout[layer].length, dtype, window + 1 if kind == SLIDING else None
        )
        for kind, layer in layers.items()
    }


class Draft(nn.Module):
    """forward(last_ids [B], hidden [B, H], positions [B]) -> (tokens [B, k], logits [B, k, V] fp32).

    `assistant`: a `Gemma4AssistantForCausalLM` whose vocabulary is the target's and whose
    `backbone_hidden_size` is the target's hidden size; `target_model`: the target's
    `Gemma4ForCausalLM` (its input embedding, and which layers' KV the assistant reads); `cache`: the
    target's `KVCache`, read only; `k`: the draft steps, unrolled."""

    def __init__(self, assistant, target_model, cache: KVCache, k: int):
        super().__init__()
        config = target_model.config
        if assistant.config.get_text_config().vocab_size != config.vocab_size:
            raise ValueError("the assistant's vocabulary is not the target's")
        if assistant.config.backbone_hidden_size != config.hidden_size:
            raise ValueError("the assistant's backbone_hidden_size is not the target's hidden_size")
        if k < 1:
            raise ValueError(f"k = {k}: a draft has at least one step")
        self.model = assistant  # `model`, as in the target's graphs: inductor.CompiledGraph reads model.model
        self.embed = target_model.model.embed_tokens  # the target's, scaled as the target scales it
        self.cache, self.k, self.window = cache, k, config.sliding_window
        self.layers = shared_layers(config)
        for kind, layer in self.layers.items():
            length = cache.layout[layer].length
            if kind == SLIDING and length < min(self.window + 1, _longest(cache)):
                raise ValueError(
                    f"the sliding ring of layer {layer} holds {length} positions: the draft reads the "
                    f"{self.window + 1} before its query (sliding_window + 1)"
                )

    def forward(self, last_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        dtype = self.embed.weight.dtype
        masks = draft_masks(positions, self.cache, self.layers, self.window, dtype)
        states = self.cache.tensors()
        shared = {kind: (states[2 * layer], states[2 * layer + 1]) for kind, layer in self.layers.items()}
        position_ids = positions.reshape(-1, 1)
        token, state = last_ids.reshape(-1, 1), hidden[:, None, :].to(dtype)
        tokens, logits = [], []
        for _ in range(self.k):
            embeds = self.model.pre_projection(torch.cat([self.embed(token), state], dim=-1))
            # no cache of its own (HF's assistant forward passes use_cache=False too): a DynamicCache made
            # here is a call torch 2.9's Dynamo, the Neuron SDK's, refuses to trace
            out = self.model.model(
                inputs_embeds=embeds,
                attention_mask=masks,
                position_ids=position_ids,
                shared_kv_states=shared,
                use_cache=False,
            )
            step = self.model.lm_head(out.last_hidden_state).float()  # [B, 1, V]
            token = step.argmax(-1)  # [B, 1]
            state = self.model.post_projection(out.last_hidden_state)
            tokens.append(token)
            logits.append(step)
        return torch.cat(tokens, dim=1), torch.cat(logits, dim=1)


def _longest(cache: KVCache) -> int:
    """The most positions any layer of the cache holds (a ring never needs more than that)."""
    return max(spec.length for spec in cache.layout)


def load_assistant(path: Path, target_model, dtype: torch.dtype | None = None):
    """The Gemma-4 assistant in directory `path` (`hub.resolve_assistant`) for `target_model`, in eval
    mode with eager attention (the draft graph's additive masks), in the target's dtype unless
    `dtype`; refused (CheckpointError) unless it fits the target (`hub.read_assistant_config`) and its
    files hold every weight."""
    config = read_assistant_config(Path(path), target_model.config)
    dtype = dtype or target_model.model.embed_tokens.weight.dtype
    try:
        model, info = Gemma4AssistantForCausalLM.from_pretrained(
            str(path), config=config, dtype=dtype, local_files_only=True, output_loading_info=True
        )
    except (OSError, ValueError) as e:
        raise CheckpointError(f"assistant {path}: cannot load its weights: {e}") from None
    wrong = {k: v for k, v in info.items() if k != "error_msgs" and v}
    if wrong or info.get("error_msgs"):
        raise CheckpointError(f"assistant {path}: its weights do not match its config: {wrong or info['error_msgs']}")
    model.set_attn_implementation("eager")
    return model.eval()

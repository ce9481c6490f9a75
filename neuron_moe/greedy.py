"""Greedy generation over an HF causal LM with a KV cache: the CPU reference loop.

Left-padded batches: positions count only real tokens (cumsum of the mask), so a padded row
generates what it would alone. Exactly `max_new_tokens` per row, EOS not special: SEQ_MATCH
compares fixed-length sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class Generation:
    tokens: torch.Tensor  # [B, N] int64, the greedy picks
    logits: torch.Tensor | None  # [B, N, V] fp32, the logits each pick was taken from (None: a graph
    # that returns the token alone, as a serving graph does)

    @staticmethod
    def cat(parts: list[Generation]) -> Generation:
        """Generations of successive batches, as one."""
        logits = None if parts[0].logits is None else torch.cat([p.logits for p in parts])
        return Generation(torch.cat([p.tokens for p in parts]), logits)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (input_ids [B, S], attention_mask [B, S]) padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def greedy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> Generation:
    cache = DynamicCache(config=model.config)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    ids = input_ids
    tokens, logits = [], []
    for step in range(max_new_tokens):
        out = model(
            input_ids=ids,
            attention_mask=attention_mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        step_logits = out.logits[:, -1].float()
        ids = step_logits.argmax(-1, keepdim=True)
        tokens.append(ids)
        logits.append(step_logits)
        attention_mask = torch.cat([attention_mask, torch.ones_like(ids)], dim=-1)
        positions = positions[:, -1:] + 1
    return Generation(torch.cat(tokens, dim=1), torch.stack(logits, dim=1))

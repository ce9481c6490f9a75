"""The host loop over the static graphs: pad to the bucket, one prefill, then one decode per token.

Only torch here: the TP ranks (`parallel/trace.py`) run this same loop in every process, and a
rank process should import nothing it does not need.
"""

from __future__ import annotations

import torch


def pad_to_bucket(input_ids: torch.Tensor, attention_mask: torch.Tensor, bucket: int, batch: int, pad_id: int):
    """Left-pad (or drop surplus pad columns) to the bucket and fill the batch with copies of the
    last row, whose outputs are dropped -> (ids, mask, positions), each [batch, bucket]."""
    rows, width = input_ids.shape
    ids = torch.full((rows, bucket), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, bucket), dtype=torch.long)
    keep = min(width, bucket)
    ids[:, bucket - keep:], mask[:, bucket - keep:] = input_ids[:, width - keep:], attention_mask[:, width - keep:]
    ids = torch.cat([ids, ids[-1:].expand(batch - rows, -1)])
    mask = torch.cat([mask, mask[-1:].expand(batch - rows, -1)])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def run_graphs(graphs: dict, batch: int, max_cache_len: int, pad_id: int, bucket: int,
               input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
               device: torch.device | str = "cpu"):
    """Greedy generation through `graphs["prefill <bucket>"]` and `graphs["decode"]` (callables
    with the static decoder's signatures) -> (tokens [rows, n], logits [rows, n, V]) on the host.
    The prompts were checked against the bucket and max_cache_len (`StaticGenerator.check`)."""
    rows = input_ids.shape[0]
    ids, mask, positions = pad_to_bucket(input_ids, attention_mask, bucket, batch, pad_id)
    # Every input is made on the host and sent as it is: a graph's only device-side inputs are
    # other graphs' outputs (the token, the KV buffers), so on a lazy device (XLA) no host-side
    # arithmetic is fused into a graph and each graph keeps one compiled form.
    token, logits, *cache = graphs[f"prefill {bucket}"](ids.to(device), mask.to(device), positions.to(device))
    tokens, all_logits = [token], [logits]
    # generated slots are real for every row; the graph masks slots after the query itself
    mask = torch.cat([mask, torch.ones(batch, max_cache_len - bucket, dtype=torch.long)], dim=1).to(device)
    for step, slot in enumerate(range(bucket, bucket + max_new_tokens - 1), start=1):
        position = (positions[:, -1:] + step).to(device)
        token, logits, *cache = graphs["decode"](token, position, torch.tensor([slot]).to(device), mask, *cache)
        tokens.append(token)
        all_logits.append(logits)
    # to the host one by one: a tensor a graph computed is a copy away, a cat on a lazy device
    # would be one more graph
    tokens, all_logits = [t.cpu() for t in tokens], [t.cpu() for t in all_logits]
    return torch.cat(tokens, dim=1)[:rows], torch.stack(all_logits, dim=1)[:rows]

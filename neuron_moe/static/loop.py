"""The host loop over the static graphs: a prefill per prompt, into its own cache row, then one
decode per token for all rows at once, each row at its own position.

The KV cache never passes through here: it is the graphs' state (`cache.py`). What the host
sends is a prompt's ids, pad mask and positions (prefill, one row: its bucket is the prompt's
own), the positions (decode), and each row's sampling (greedy here: `sampling.GREEDY`); what comes
back is the token (and the logits, from a graph built to return them). This is the shape a
continuous-batching engine drives: a waiting request is prefilled into a free row while the others
sit mid-generation.

Only torch here: the TP ranks (`parallel/trace.py`) run this same loop in every process, and a
rank process should import nothing it does not need.
"""

from __future__ import annotations

import torch

from .sampling import GREEDY


def prefill_row(prompt: torch.Tensor, bucket: int, pad_id: int, start: int = 0):
    """One chunk's ids [n] at positions start..start+n-1 -> (input_ids, attention_mask,
    position_ids), each [1, bucket], left-padded (a pad's position is the chunk's first)."""
    n = prompt.shape[0]
    ids = torch.full((1, bucket), pad_id, dtype=torch.long)
    mask = torch.zeros((1, bucket), dtype=torch.long)
    ids[0, bucket - n :], mask[0, bucket - n :] = prompt, 1
    return ids, mask, start + (mask.cumsum(-1) - 1).clamp(min=0)


def greedy_sampling(rows: int) -> torch.Tensor:
    """The `sampling` input of `rows` greedy rows ([rows, 4])."""
    return torch.tensor([GREEDY] * rows)


def bucket_for(n: int, buckets) -> int:
    """The smallest bucket that holds n tokens (the caller checked that one does)."""
    return next(b for b in sorted(buckets) if b >= n)


def run_graphs(
    graphs: dict,
    batch: int,
    pad_id: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    device: torch.device | str = "cpu",
):
    """Greedy generation through `graphs["prefill <bucket>"]` and `graphs["decode"]` (callables
    with the static decoder's signatures, sharing one KV state) for a left-padded batch of at most
    `batch` prompts -> (tokens [rows, n], logits [rows, n, V] or None) on the host. Row r of the
    batch is cache row r; the rows past the prompts idle at position 0. The prompts were checked
    against the buckets and max_cache_len (`StaticGenerator.check`)."""
    rows, width = input_ids.shape
    lengths = attention_mask.sum(-1)
    buckets = sorted(int(k.split()[1]) for k in graphs if k.startswith("prefill "))
    # Every input is made on the host and sent as it is: a graph's only device-side inputs are
    # other graphs' outputs (the token), so on a lazy device (XLA) no host-side arithmetic is
    # fused into a graph and each graph keeps one compiled form.
    first = []
    for row, n in enumerate(lengths.tolist()):
        bucket = bucket_for(n, buckets)
        inputs = (*prefill_row(input_ids[row, width - n :], bucket, pad_id), torch.tensor([row]), greedy_sampling(1))
        first.append(graphs[f"prefill {bucket}"](*(x.to(device) for x in inputs)))
    # the first tokens to the host, where the decode batch is put together (a cat on a lazy
    # device would be one more graph)
    token = torch.full((batch, 1), pad_id, dtype=torch.long)
    token[:rows] = torch.cat([out[0].cpu() for out in first])
    tokens, step_logits = [token[:rows]], []
    if len(first[0]) > 1:
        step_logits.append(torch.cat([out[1].cpu() for out in first]))
    start = torch.zeros(batch, 1, dtype=torch.long)
    start[:rows, 0] = lengths
    active = torch.arange(batch)[:, None] < rows
    token, sampling = token.to(device), greedy_sampling(batch).to(device)
    for step in range(max_new_tokens - 1):
        positions = torch.where(active, start + step, 0)  # the fed token's position
        out = graphs["decode"](token, positions.to(device), sampling)
        token = out[0]
        tokens.append(token)
        if step_logits:
            step_logits.append(out[1])
    # to the host one by one: a tensor a graph computed is a copy away, a cat on a lazy device
    # would be one more graph
    tokens = torch.cat([t.cpu()[:rows] for t in tokens], dim=1)
    logits = torch.stack([t.cpu()[:rows] for t in step_logits], dim=1) if step_logits else None
    return tokens, logits

"""Decode batches of B tokens from different sequences: the reader's batch rule against
independent per-token top-k (reader/batch.py), inside the model.

The evaluation split's sequences (`reader_eval.sequences`) are decoded B at a time as a continuous
batch over the static decoder's per-row KV cache (`static/decoder.py`): each row holds one
sequence, its prompt prefilled with the full experts (every position before its first scored one),
then one decode step per position, every row at its own position. Teacher-forced: the true next
token is fed, so each token's context is its own sequence's, decoded by the same rule. A row whose
sequence ends takes the next one; once every sequence has started, rows take them again from the
start, unscored (fillers), so every step holds B tokens until the last scored sequence ends. The
sequences are shuffled once (seeded), so a step mixes tasks.

Each decode step's routed experts go through a `selectors.Step` rule over the step's tokens (the
idle rows of the last steps take no part); what the step read is recorded per layer, each row
once. Greedy generation (`generate`) runs the same loop feeding each row's greedy pick: task
accuracy with batched decoding.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import torch

from .. import spec
from ..experts.selector_experts import attach_selector
from ..static.decoder import Decode, Prefill, new_cache
from ..static.loop import greedy_sampling
from .reader_eval import Sequence


@dataclass
class Row:
    seq: int  # index into the sequences
    fed: list[int]  # the tokens fed so far and the next: the sequence (teacher-forced) or prompt + picks
    pos: int  # the position of the token fed next
    end: int  # the last position to feed
    scored: bool = True  # False: a filler, decoded only to keep the step full


@dataclass
class Decoded:
    logprobs: list  # per sequence: log-probs at its fed positions from its first scored one, [n, V]
    picks: list  # per sequence: the greedy picks at those positions
    steps: list  # per decode step: {"tokens": active rows, "layers": [{"bytes", "experts", "exact"}, ...]}


def order(count: int, seed: int = 0) -> list[int]:
    """The order rows take the sequences in: shuffled once, seeded, so a step mixes tasks."""
    ids = list(range(count))
    random.Random(seed).shuffle(ids)
    return ids


@torch.no_grad()
def decode(model, seqs: list[Sequence], batch: int, states=None, new_tokens: list[int] | None = None,
           eos: int | None = None, seed: int = 0, progress=None) -> Decoded:
    """Decode `seqs` B = `batch` rows at a time. With selector `states` (attach_selector, Step rules)
    the decode steps run them, else the full experts. `new_tokens`: greedy generation of that many
    tokens per sequence after its prompt (stopping at `eos`), instead of teacher forcing."""
    longest = max(len(s.ids) + (new_tokens[i] if new_tokens else 0) for i, s in enumerate(seqs))
    cache = new_cache(model, longest, batch)
    prefill = Prefill(model, cache, "eager")
    step = Decode(model, cache, "selector" if states else "eager", logits=True)
    queue = deque(order(len(seqs), seed))
    fillers = deque()
    rows: list[Row | None] = [None] * batch
    out = Decoded([[] for _ in seqs], [[] for _ in seqs], [])

    def take(r: int) -> None:
        rows[r] = None
        scored = bool(queue)
        if not scored and not any(row and row.scored for row in rows):
            return
        if not scored and not fillers:
            fillers.extend(order(len(seqs), seed))
        i = (queue if scored else fillers).popleft()
        s = seqs[i]
        row = Row(i, list(s.ids), s.start, len(s.ids) - 2 + (new_tokens[i] if new_tokens else 0), scored)
        if s.start:  # the prompt before the first scored position: prefilled, full experts
            ids = torch.tensor([s.ids[:s.start]])
            prefill(ids, torch.ones_like(ids), torch.arange(s.start)[None], torch.tensor([r]), greedy_sampling(1))
        rows[r] = row

    for r in range(batch):
        take(r)
    while any(row and row.scored for row in rows):
        active = torch.tensor([row is not None for row in rows])
        ids = torch.tensor([[row.fed[row.pos] if row else 0] for row in rows])
        positions = torch.tensor([[row.pos if row else 0] for row in rows])
        for state in states or ():
            state.active, state.results = active, []
        _, logits = step(ids, positions, greedy_sampling(batch))
        if states:
            out.steps.append({"tokens": int(active.sum()), "layers": [
                {"bytes": int(st.results[0].reads[0]), "experts": st.results[0].step.experts,
                 "exact": st.results[0].step.exact} for st in states]})
        logprobs = logits.log_softmax(-1)
        scored = sum(1 for row in rows if row and row.scored)
        for r, row in enumerate(rows):
            if row is None:
                continue
            pick = int(logits[r].argmax())
            if row.scored:
                out.logprobs[row.seq].append(logprobs[r])
                out.picks[row.seq].append(pick)
            if new_tokens and row.pos + 1 >= len(row.fed):
                row.fed.append(pick)
            row.pos += 1
            if row.pos > row.end or (new_tokens and pick == eos):
                take(r)
        if progress is not None:
            progress.update(scored)
    out.logprobs = [torch.stack(lp) if lp else torch.zeros(0) for lp in out.logprobs]
    for state in states or ():
        state.active, state.results = None, None
    return out


def run_rule(model, seqs, batch, name, layers, rules, **kw) -> Decoded:
    """`decode` with selector `name` and rules[i] in layer i; the model's experts back to eager after."""
    states = attach_selector(model, name, layers, rules)
    try:
        return decode(model, seqs, batch, states, **kw)
    finally:
        spec.set_experts(model, spec.EAGER)

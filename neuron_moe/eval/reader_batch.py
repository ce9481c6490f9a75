"""Decode batches of B tokens from different sequences: the reader's batch rule against
independent per-token top-k (reader/batch.py), inside the model.

The evaluation split's sequences (`reader_eval.sequences`) are decoded B at a time as a continuous
batch over the static decoder's per-row KV cache: the engine step of `static/rows.py`, which serving
drives too. Each row holds one sequence, its prompt prefilled with the full experts (every
position before its first scored one, alone at its own length), then one decode step per
position, every row at its own position. Teacher-forced: the true next token is fed, so each
token's context is its own sequence's, decoded by the same rule. A row whose sequence ends takes
the next one; once every sequence has started, rows take them again from the start, unscored
(fillers), so every step holds B tokens until the last scored sequence ends. The sequences are
shuffled once (seeded), so a step mixes tasks.

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
from ..run_config import Shapes
from ..static.decoder import Decode, Prefill, new_cache
from ..static.rows import GraphRuntime, Rows
from ..static.sampling import GREEDY
from .reader_eval import Sequence


@dataclass
class Row:
    """One sequence in a row of the batch (the work a `Rows` runs)."""

    prompt: list[int]  # prefilled with the full experts: the positions before the first scored one
    fed: list[int]  # the tokens fed so far and the next: the sequence (teacher-forced) or prompt + picks
    pos: int  # the position of the token fed next
    last: int  # the last position to feed
    logprobs: list | None  # its fed positions' log-probs [V] go here; None: a filler, decoded to keep the step full
    picks: list | None  # and its greedy picks
    generate: bool = False  # greedy generation: each pick is fed after the sequence's own tokens
    eos: int | None = None  # greedy generation stops at it
    decoding: bool = False  # past its prompt

    @property
    def scored(self) -> bool:
        return self.logprobs is not None

    def sampling(self) -> tuple[float, float, float, float]:
        return GREEDY

    def next(self, token: int | None, logits: torch.Tensor | None) -> int | None:
        if not self.decoding:  # prefilled (or nothing to prefill): feed its first scored position's input
            self.decoding = True
            return self.fed[self.pos]
        pick = int(logits.argmax())
        if self.scored:
            self.logprobs.append(logits.log_softmax(-1))
            self.picks.append(pick)
        if self.generate and self.pos + 1 >= len(self.fed):
            self.fed.append(pick)
        self.pos += 1
        if self.pos > self.last or (self.generate and pick == self.eos):
            return None
        return self.fed[self.pos]

    def end(self, error: Exception | None = None) -> None:
        """Nothing to release: a failed graph call raises to `decode`'s caller."""


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
def decode(
    model,
    seqs: list[Sequence],
    batch: int,
    states=None,
    new_tokens: list[int] | None = None,
    eos: int | None = None,
    seed: int = 0,
    progress=None,
) -> Decoded:
    """Decode `seqs` B = `batch` rows at a time. With selector `states` (attach_selector, Step rules)
    the decode steps run them, else the full experts. `new_tokens`: greedy generation of that many
    tokens per sequence after its prompt (stopping at `eos`), instead of teacher forcing."""
    longest = max(len(s.ids) + (new_tokens[i] if new_tokens else 0) for i, s in enumerate(seqs))
    cache = new_cache(model, longest, batch)
    decode_graph = Decode(model, cache, "selector" if states else "eager", logits=True)

    def decode_step(ids, positions, sampling):
        """The decode graph, its rows (the idle ones take no part) handed to the selector states first."""
        generating, active = rows.generating(), torch.zeros(batch, dtype=torch.bool)
        active[generating] = True
        for state in states or ():
            state.active, state.results = active, []
        if progress is not None:
            progress.update(sum(rows.slots[row].scored for row in generating))
        return decode_graph(ids, positions, sampling)

    # every prompt prefilled in the step that admits it, each alone at its own length with the full
    # experts (no bucket, no padding: a position's numbers are the plain forward's)
    prefill = Prefill(model, cache, "eager")
    rows = Rows(GraphRuntime(prefill, decode_step, Shapes(batch_size=batch, prefill_chunk=longest)), prefill_all=True)
    queue = deque(order(len(seqs), seed))
    fillers = deque()
    out = Decoded([[] for _ in seqs], [[] for _ in seqs], [])

    def take() -> Row | None:
        """The next sequence for a free row: scored ones first, then fillers while a scored one runs."""
        scored = bool(queue)
        if not scored and not any(row.scored for row in rows.slots if row):
            return None
        if not scored and not fillers:
            fillers.extend(order(len(seqs), seed))
        i = (queue if scored else fillers).popleft()
        s = seqs[i]
        return Row(
            s.ids[: s.start],
            list(s.ids),
            s.start,
            len(s.ids) - 2 + (new_tokens[i] if new_tokens else 0),
            out.logprobs[i] if scored else None,
            out.picks[i] if scored else None,
            bool(new_tokens),
            eos,
        )

    while queue or any(row is not None and row.scored for row in rows.slots):  # fillers end with the scored
        rows.step(take)
        if states:
            out.steps.append(
                {
                    "tokens": int(states[0].active.sum()),
                    "layers": [
                        {
                            "bytes": int(st.results[0].reads[0]),
                            "experts": st.results[0].step.experts,
                            "exact": st.results[0].step.exact,
                        }
                        for st in states
                    ],
                }
            )
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

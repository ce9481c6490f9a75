"""The static-shape Gemma-4 decoder: one prefill graph per bucket and one decode graph.

Both wrap transformers' own Gemma4ForCausalLM — HF's embedding, attention, router, dense MLP
and norms run unchanged. What is ours: the KV cache (`KVCache`, module state shared by every
graph built over it, written per row: `cache.py`), the attention masks (built from an
attention-mask input or from the positions, and handed to HF as a dict per layer type, so
transformers' masking_utils and its host-side checks never run), and which fixed-shape experts
implementation each graph uses.

The calls (every shape fixed at build time; P prefill rows, B = the cache's rows):

  Prefill  (input_ids [P, bucket], attention_mask [P, bucket], position_ids [P, bucket],
            row_ids [P]) -> token [P, 1]
           each prompt left-padded to the bucket; writes cache rows `row_ids` only
  Decode   (input_ids [B, 1], position_ids [B, 1]) -> token [B, 1]
           every row at its own position; a row with nothing to do writes its own slot only

The token is the greedy pick (argmax in the graph). A graph built with `logits=True` also returns
the fp32 logits it came from ([rows, V], after the token): for validation, never for serving,
where only the token may cross to the host. With an aliased cache (NxD), the new state follows
as extra outputs, mapped onto the state by `output_aliases()`.

Sampling: `pick` is the one place a graph chooses the token. The serving engine
(`serve/batching.py`) takes it as it is for greedy rows and samples the other rows on the host
from the logits of a `logits=True` graph, with each request's own seeded generator. On-device
sampling would plug in at `pick`: a `sampling [B, 3]` input after the positions (temperature,
top_p, and a uniform draw u in [0, 1) from the request's generator on the host), and `pick`
greedy where temperature == 0, else softmax(logits / temperature) cut to the top_p nucleus and
inverted at u (a cumsum and a compare: fixed shapes) — what NxD's OnDeviceSamplingConfig does.
Until then, an artifact without logits serves temperature 0 only.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .cache import SLIDING, GraphCache, KVCache, cache_layout, decode_mask, prefill_mask


@contextmanager
def experts_implementation(model, name: str):
    """HF dispatches the experts on `config._experts_implementation` at call time; the prefill
    and decode graphs share one model but not one implementation, so each sets its own for the
    duration of its forward (a trace records the one that was set)."""
    previous = model.config._experts_implementation
    model.config._experts_implementation = name
    try:
        yield
    finally:
        model.config._experts_implementation = previous


def new_cache(model, max_cache_len: int, rows: int, aliased: bool = False) -> KVCache:
    """Zeroed KV state for `model` (its KV heads per layer: a rank module's are its own share)."""
    weight = model.model.embed_tokens.weight
    return KVCache(cache_layout(model.config, max_cache_len), rows, weight.dtype, weight.device, aliased)


class _StaticGraph(torch.nn.Module):
    def __init__(self, model, cache: KVCache, experts: str, logits: bool = False):
        super().__init__()
        self.model = model
        self.cache = cache  # its tensors are named cache.k0, cache.v0, ... (cache.STATE)
        self.experts, self.logits = experts, logits
        # per layer type: the sliding window (None for global layers) and the ring length
        self.kinds = {spec.kind: (model.config.sliding_window if spec.kind == SLIDING else None, spec.length)
                      for spec in cache.layout}

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    @property
    def user_outputs(self) -> int:
        return 2 if self.logits else 1

    def output_aliases(self) -> dict[torch.nn.Parameter, int]:
        """NxD's input_output_aliases: each state parameter -> the output that replaces it."""
        if not self.cache.aliased:
            raise ValueError("output_aliases() is for an aliased cache (NxD); this one is mutated in place")
        return {t: self.user_outputs + i for i, t in enumerate(self.cache.tensors())}

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, V] fp32 -> the next token [rows, 1] (greedy; on-device sampling would go here)."""
        return logits.argmax(-1, keepdim=True)

    def _run(self, input_ids, masks, position_ids, cache: GraphCache):
        with experts_implementation(self.model, self.experts):
            out = self.model(input_ids=input_ids, attention_mask=masks, position_ids=position_ids, cache=cache,
                             use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].float()
        token = self.pick(logits)
        return ((token, logits) if self.logits else (token,)) + self.cache.commit(cache.new)


class Prefill(_StaticGraph):
    """forward(input_ids, attention_mask, position_ids, each [P, bucket]; row_ids [P]).

    The rows are left-padded to the bucket: the last column is every row's last prompt token.
    """

    def forward(self, input_ids, attention_mask, position_ids, row_ids):
        masks = {kind: prefill_mask(attention_mask, window, self.dtype) for kind, (window, _) in self.kinds.items()}
        return self._run(input_ids, masks, position_ids, GraphCache(self.cache, position_ids, row_ids))


class Decode(_StaticGraph):
    """forward(input_ids [B, 1], position_ids [B, 1]): row b's token at its position."""

    def forward(self, input_ids, position_ids):
        masks = {kind: decode_mask(position_ids, length, self.dtype) for kind, (_, length) in self.kinds.items()}
        return self._run(input_ids, masks, position_ids, GraphCache(self.cache, position_ids))

"""The static-shape Gemma-4 decoder: one prefill graph per bucket, decode graphs by KV length.

Both wrap transformers' own Gemma4ForCausalLM — HF's embedding, attention, router, dense MLP
and norms run unchanged. What is ours: the KV cache (`KVCache`, module state shared by every
graph built over it, written per row: `cache.py`), the attention masks (built from an
attention-mask input or from the positions, and handed to HF as a dict per layer type, so
transformers' masking_utils and its host-side checks never run), and which fixed-shape experts
implementation each graph uses: given when the graph is built, which then holds a view of the
model whose experts modules dispatch to it (`experts/view.py`).

The calls (every shape fixed at build time; P prefill rows, B = the cache's rows):

  Prefill  (input_ids [P, bucket], attention_mask [P, bucket], position_ids [P, bucket],
            row_ids [P], sampling [P, 4]) -> token [P, 1]
           each row a chunk of a prompt, left-padded to the bucket, at its own positions: the
           first chunk of a prompt starts at 0, a later one where the one before ended and
           attends to the row's cache too (chunked prefill); writes cache rows `row_ids` only
           (a row id may repeat with the very same inputs: P is padded that way)
  Decode   (input_ids [B, 1], position_ids [B, 1], sampling [B, 4]) -> token [B, 1]
           every row at its own position; a row with nothing to do writes its own slot only.
           Built with `span` L, it attends over the first L positions of the cache (NxDI's
           token-generation buckets, `cache.GraphCache`): the runtime runs the smallest L above
           every row's position, the graph of the whole cache (span None) where none is
  Verify   (input_ids [B, q], position_ids [B, q], sampling [B, 4], drafted [B], uniforms [B, q])
           -> tokens [B, q], accepted [B]
           speculative decoding: each row's fed token and up to q - 1 drafts, at q positions from
           its own; column i's token the one Decode would pick there, the drafts taken while they
           are those tokens (a cache with `slack` q - 1: the rejected drafts' slots, `cache.py`)
  Step     (the prefill's five inputs at [P, bucket], then the decode's three at [B, 1])
             -> token [P + B, 1] (the chunks' first, then every row's)
           a prefill chunk of P rows and a decode step of every row in one forward over the cache,
           as one flat batch of P·bucket + B tokens: every op but attention runs once over all of
           them (the experts, the MLP, the projections); attention runs per part as the two graphs
           run it, the chunks' rings written first (vLLM V1's and llama.cpp's unified batch). A row
           being prefilled sits in the decode part as a pad at its position after its chunk
  Copy     (src_row [1], dst_row [1]) -> dst_row [1, 1]
           row src_row of every layer's K and V copied whole into row dst_row (prefix caching:
           the destination's prompt begins with a prefix the source holds; `cache.copy_rows`)

The token is chosen in the graph (`pick`, `sampling.py`): per row, greedy at temperature 0, else
temperature, top-k and top-p from the row's own uniform draw. A graph built with `logits=True`
also returns the fp32 logits it came from ([rows, V], after the token): for validation, never for
serving, where only the token crosses to the host. With an aliased cache (NxD), the new state
follows as extra outputs, mapped onto the state by `output_aliases()`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.models.gemma4.modeling_gemma4 import eager_attention_forward

from .. import spec
from ..experts.view import with_experts
from ..speculative import accepted_drafts
from .cache import SLIDING, GraphCache, KVCache, TokenCounts, attended, cache_layout, chunk_mask, copy_rows, decode_mask
from .sampling import CANDIDATES, TOP_LOGPROBS, count_tokens, logprobs, process
from .sampling import pick as pick_token


def new_cache(
    model, max_cache_len: int, rows: int, aliased: bool = False, whole_rows: bool = False, slack: int = 0
) -> KVCache:
    """Zeroed KV state for `model` (its KV heads per layer: a rank module's are its own share);
    `whole_rows`: the layout prefix caching copies rows of; `slack`: the slots a verify graph of
    `slack` drafts writes past a row's latest position (`cache.cache_layout`)."""
    weight = model.model.embed_tokens.weight
    layout = cache_layout(model.config, max_cache_len, whole_rows, slack)
    return KVCache(layout, rows, weight.dtype, weight.device, aliased)


def new_counts(model, rows: int, aliased: bool = False) -> TokenCounts:
    """Zeroed token counts of `rows` rows for the logits-processing graphs (`cache.TokenCounts`)."""
    return TokenCounts(rows, model.config.vocab_size, model.model.embed_tokens.weight.device, aliased)


class _StaticGraph(torch.nn.Module):
    def __init__(
        self,
        model,
        cache: KVCache,
        experts: spec.Experts | str,
        logits: bool = False,
        candidates: int = CANDIDATES,
        span: int | None = None,
    ):
        super().__init__()
        self.span = span  # a decode graph's: the KV positions it attends over (None: the whole cache)
        self.experts = spec.experts(experts)  # this graph's experts implementation (an entry, or its name)
        self.model = with_experts(model, self.experts)  # the model's weights, its experts dispatching to ours
        self.cache = cache  # its tensors are named cache.k0, cache.v0, ... (cache.STATE)
        self.logits = logits
        self.candidates = min(candidates, model.config.vocab_size)  # top-k / top-p candidate width
        # per layer type: the sliding window (None for global layers) and the ring length
        self.kinds = {
            spec.kind: (model.config.sliding_window if spec.kind == SLIDING else None, spec.length)
            for spec in cache.layout
        }

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

    def pick(self, logits: torch.Tensor, sampling: torch.Tensor) -> torch.Tensor:
        """[rows, V] fp32, [rows, 4] sampling -> the next token [rows, 1] (`sampling.pick`)."""
        return pick_token(logits, sampling.float(), self.candidates)

    def _chunk(self, attention_mask, position_ids, row_ids) -> tuple[dict, GraphCache]:
        """A prefill chunk's masks per layer type and the cache it writes (rows `row_ids`, each from
        its chunk's first position, `GraphCache.start`)."""
        start = position_ids[:, -1:] + 1 - attention_mask.sum(-1, keepdim=True)  # [P, 1]
        masks = {
            kind: chunk_mask(attention_mask, position_ids, start, window, length, self.dtype)
            for kind, (window, length) in self.kinds.items()
        }
        return masks, GraphCache(self.cache, position_ids, row_ids, start)

    def _step(self, position_ids) -> tuple[dict, GraphCache]:
        """A decode step's masks per layer type over the positions it attends (`span`) and the cache it
        writes (every row at its position)."""
        masks = {
            kind: decode_mask(position_ids, attended(length, self.span), self.dtype, window)
            for kind, (window, length) in self.kinds.items()
        }
        return masks, GraphCache(self.cache, position_ids, span=self.span)

    def _logits(self, input_ids, masks, position_ids, cache: GraphCache, keep: int = 1) -> torch.Tensor:
        """HF's model over the inputs -> fp32 logits [rows, keep, V] (keep 0: every column)."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=masks,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.logits.float()

    def _run(self, input_ids, masks, position_ids, sampling, cache: GraphCache):
        logits = self._logits(input_ids, masks, position_ids, cache)[:, -1]
        token = self.pick(logits, sampling)
        return ((token, logits) if self.logits else (token,)) + self.cache.commit(cache.new)


class Prefill(_StaticGraph):
    """forward(input_ids, attention_mask, position_ids, each [P, bucket]; row_ids [P]; sampling [P, 4]).

    The rows are left-padded to the bucket: the last column is every row's last token of the
    chunk, and a row's chunk starts at position `position_ids[:, -1] + 1 - (its real tokens)`.
    """

    def forward(self, input_ids, attention_mask, position_ids, row_ids, sampling):
        masks, cache = self._chunk(attention_mask, position_ids, row_ids)
        return self._run(input_ids, masks, position_ids, sampling, cache)


class Decode(_StaticGraph):
    """forward(input_ids [B, 1], position_ids [B, 1], sampling [B, 4]): row b's token at its position."""

    def forward(self, input_ids, position_ids, sampling):
        masks, cache = self._step(position_ids)
        return self._run(input_ids, masks, position_ids, sampling, cache)


class Verify(_StaticGraph):
    """The target's verify graph (speculative decoding): each row's fed token and its drafts, checked
    in one call at q = k + 1 positions.

    forward(input_ids [B, q], position_ids [B, q], sampling [B, 4], drafted [B] int64, uniforms [B, q])
      -> tokens [B, q], accepted [B] int64 (, logits [B, q, V]) (, hidden [B, q, H])

    `hidden` (built for an assistant, `draft.Draft`): the target's final hidden state at each column
    (post-norm, what its lm_head reads: HF's `hidden_states[-1]`), the assistant's input for the
    row's next drafts (the column of its last accepted token).

    Row b feeds its next token at position p then its drafts at p+1.., `drafted[b]` of them (the rest
    of the row padded, at the positions after them; a row with nothing to do feeds pads). Every
    position's KV is written, attending as a decode step at that position would (`decode_mask`): the
    slots of rejected and padded drafts are rewritten by the row's next call before any query reads
    them, which the cache's slack (`cache_layout`) guarantees. Column i's token is the one the decode
    graph would pick after the row's input up to column i (`pick`, at u = uniforms[:, i]) and
    `accepted` the leading drafts that are those very tokens (`speculative.accepted_drafts`):
    tokens[b, :accepted[b] + 1] is what that many decode steps give, the last a correction or the
    bonus token. For a greedy row that is greedy decoding itself; for a sampled row, rejection
    sampling against a deterministic draft, so its tokens follow the target's distribution as `pick`
    processes it (temperature, top-k, top-p).
    """

    def __init__(self, model, cache: KVCache, experts, logits: bool = False, hidden: bool = False, **kw):
        super().__init__(model, cache, experts, logits, **kw)
        self.hidden = hidden

    @property
    def user_outputs(self) -> int:
        return 2 + self.logits + self.hidden

    def forward(self, input_ids, position_ids, sampling, drafted, uniforms):
        masks, cache = self._step(position_ids)
        # the decoder, then HF's lm_head and final softcapping (Gemma4ForCausalLM's), keeping the hidden state
        hidden = self.model.model(
            input_ids=input_ids, attention_mask=masks, position_ids=position_ids, cache=cache, use_cache=True
        ).last_hidden_state
        logits = self.model.lm_head(hidden)
        cap = self.model.config.final_logit_softcapping
        logits = (torch.tanh(logits / cap) * cap if cap is not None else logits).float()  # [B, q, V]
        rows, q, vocab = logits.shape
        sampling = sampling.float()
        per_column = torch.cat([sampling[:, None, :3].expand(rows, q, 3), uniforms[:, :, None]], dim=-1)
        flat = logits.reshape(rows * q, vocab)
        tokens = self.pick(flat, per_column.reshape(rows * q, 4)).reshape(rows, q)
        accepted = accepted_drafts(input_ids, tokens, drafted)
        outputs = (tokens, accepted) + ((logits,) if self.logits else ()) + ((hidden,) if self.hidden else ())
        return outputs + self.cache.commit(cache.new)


STEP_ATTENTION = "neuron_moe_step"  # the attention `Step`'s view of the model dispatches to (`_step_attention`)


def _parts(t: torch.Tensor, rows: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's flat [1, heads, rows·bucket + B, d] -> the chunks' [rows, heads, bucket, d] and the
    decode rows' [B, heads, 1, d]."""
    n = rows * bucket
    return t[0, :, :n].unflatten(1, (rows, bucket)).transpose(0, 1), t[0, :, n:].transpose(0, 1).unsqueeze(2)


class _StepCache:
    """What HF's attention layers call in a `Step`: each layer's flat K/V split into the chunks' and the
    decode rows', the chunks written into their rows' rings, then the decode rows' into that, as the
    prefill and decode graphs write them one call after the other; what each part attends over is
    kept for `_step_attention` (HF's attention gets the flat K/V back, unused)."""

    def __init__(self, chunks: GraphCache, decode: GraphCache):
        self.chunks, self.decode, self.state = chunks, decode, chunks.state
        self.new: list[torch.Tensor | None] = [None] * len(self.state.names)
        self.attend: dict[int, tuple] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        rows, bucket = self.chunks.positions.shape
        (key_chunks, key_rows), (value_chunks, value_rows) = (_parts(t, rows, bucket) for t in (key, value))
        length = self.state.layout[layer_idx].length
        old = self.state.tensors()[2 * layer_idx : 2 * layer_idx + 2]
        written, chunks = self.chunks.write(old, key_chunks, value_chunks, length)
        new, decode = self.decode.write(written, key_rows, value_rows, length)
        self.new[2 * layer_idx], self.new[2 * layer_idx + 1] = new
        self.attend[layer_idx] = (chunks, decode)
        return key, value


@dataclass
class _StepMask:
    """A step's attention mask of one layer type: the chunks' and the decode rows', and the cache that
    holds what each part attends over."""

    chunks: torch.Tensor  # [P, 1, bucket, ring + bucket]
    decode: torch.Tensor  # [B, 1, 1, ring]
    cache: _StepCache


def _step_attention(module, query, key, value, attention_mask: _StepMask, **kwargs):
    """HF's eager attention of a step's two parts, each as its own graph runs it -> [1, P·bucket + B,
    heads, d] in the flat batch's order."""
    (key_chunks, value_chunks), (key_rows, value_rows) = attention_mask.cache.attend[module.layer_idx]
    rows, bucket = attention_mask.chunks.shape[0], attention_mask.chunks.shape[2]
    query_chunks, query_rows = _parts(query, rows, bucket)
    chunks, _ = eager_attention_forward(module, query_chunks, key_chunks, value_chunks, attention_mask.chunks, **kwargs)
    decode, _ = eager_attention_forward(module, query_rows, key_rows, value_rows, attention_mask.decode, **kwargs)
    return torch.cat([chunks.flatten(0, 1), decode.flatten(0, 1)])[None], None


AttentionInterface.register(STEP_ATTENTION, _step_attention)


def _with_step_attention(view):
    """`view` (a graph's view of the model: `with_experts`) with every attention module dispatching to
    `_step_attention`: a copy of each decoder layer and its attention module, with a config of its own."""
    layers = view.model.layers
    for key, layer in list(layers._modules.items()):
        layer = layers._modules[key] = copy.copy(layer)
        layer._modules = dict(layer._modules)
        attention = layer._modules["self_attn"] = copy.copy(layer.self_attn)
        attention.config = copy.copy(attention.config)
        attention.config._attn_implementation = STEP_ATTENTION
    return view


class Step(_StaticGraph):
    """forward(input_ids, attention_mask, position_ids [P, bucket], row_ids [P], sampling [P, 4],
    decode_ids [B, 1], decode_positions [B, 1], decode_sampling [B, 4]) -> token [P + B, 1]: a
    `Prefill` of the chunks and a `Decode` of every row, in one forward (the flat batch: the chunks'
    tokens row after row, then the decode rows'). The logits are taken at each chunk's last column and
    each decode row only."""

    def __init__(self, model, cache: KVCache, experts, logits: bool = False, **kw):
        super().__init__(model, cache, experts, logits, **kw)
        self.model = _with_step_attention(self.model)

    def forward(
        self, input_ids, attention_mask, position_ids, row_ids, sampling, decode_ids, decode_positions, decode_sampling
    ):
        chunk_masks, chunks = self._chunk(attention_mask, position_ids, row_ids)
        decode_masks, decode = self._step(decode_positions)
        cache = _StepCache(chunks, decode)
        masks = {kind: _StepMask(chunk_masks[kind], decode_masks[kind], cache) for kind in chunk_masks}
        rows, bucket = input_ids.shape
        flat = rows * bucket
        keep = torch.cat([torch.arange(rows) * bucket + (bucket - 1), torch.arange(decode_ids.shape[0]) + flat])
        ids = torch.cat([input_ids.reshape(1, -1), decode_ids.reshape(1, -1)], dim=1)
        positions = torch.cat([position_ids.reshape(1, -1), decode_positions.reshape(1, -1)], dim=1)
        logits = self._logits(ids, masks, positions, cache, keep=keep.to(ids.device))[0]
        token = self.pick(logits, torch.cat([sampling, decode_sampling]))
        return ((token, logits) if self.logits else (token,)) + self.cache.commit(cache.new)


class _Processing(_StaticGraph):
    """A logits-processing variant: its graph also holds the rows' token counts (`TokenCounts`), state
    beside the KV cache, committed after it."""

    def __init__(self, model, cache: KVCache, counts: TokenCounts, experts, logits: bool = False, **kw):
        super().__init__(model, cache, experts, logits, **kw)
        self.counts = counts  # its tensors are named counts.output, counts.prompt (cache.COUNTS)

    def output_aliases(self) -> dict[torch.nn.Parameter, int]:
        if not self.cache.aliased or not self.counts.aliased:
            raise ValueError("output_aliases() is for an aliased cache and counts (NxD); these are mutated in place")
        state = [*self.cache.tensors(), *self.counts.tensors()]
        return {t: self.user_outputs + i for i, t in enumerate(state)}

    def _commit(self, cache: GraphCache, counts: list[torch.Tensor]) -> tuple:
        return self.cache.commit(cache.new) + self.counts.commit(counts)


class ProcessingDecode(_Processing):
    """The logits-processing decode graph: the rows that ask for more than temperature/top-k/top-p.

    forward(input_ids [B, 1], position_ids [B, 1], sampling [B, 4], process [B, 7] fp32,
            bias_ids [B, BIAS_WIDTH] int64, bias [B, BIAS_WIDTH] fp32, mask [B, ceil(V/32)] int32)
      -> token [B, 1], logprob [B, 1] (the token's, under the model's own distribution), rank [B, 1]
         int64 (its place in that distribution), top_ids [B, TOP_LOGPROBS] int64, top_logprobs
         [B, TOP_LOGPROBS] fp32 (, logits [B, V])

    Each row's fed token first counts into its token counts as `process` flags it, then its logits
    are processed (`sampling.process`: bitmask, bias and bans, penalties, min_p) and its token picked
    from them as `Decode` picks it; a row of neutral inputs gets `Decode`'s very token.
    """

    @property
    def user_outputs(self) -> int:
        return 6 if self.logits else 5

    def forward(self, input_ids, position_ids, sampling, process_row, bias_ids, bias, mask):
        masks, cache = self._step(position_ids)
        raw = self._logits(input_ids, masks, position_ids, cache)[:, -1]
        output_counts, prompt_seen = count_tokens(*self.counts.tensors(), input_ids, process_row)
        sampling = sampling.float()
        processed = process(raw, sampling[:, 0], process_row, bias_ids, bias, mask, output_counts, prompt_seen)
        token = pick_token(processed, sampling, self.candidates, torch.isfinite(raw.sum(-1)))
        chosen, rank, top_ids, top = logprobs(raw, token[:, 0], TOP_LOGPROBS)
        outputs = (token, chosen[:, None], rank[:, None], top_ids, top) + ((raw,) if self.logits else ())
        return outputs + self._commit(cache, [output_counts, prompt_seen])


class ProcessingPrefill(_Processing):
    """The logits-processing prefill graph: chunks of the prompts of rows that ask.

    forward(input_ids, attention_mask, position_ids [P, bucket], row_ids [P], targets [P, bucket] int64)
      -> logprob [P, bucket] (each column's target: the prompt token after it, under the model's own
         distribution), rank [P, bucket] int64 (the target's place in it), top_ids [P, bucket,
         TOP_LOGPROBS] int64, top_logprobs [P, bucket, TOP_LOGPROBS]

    Writes the rows' KV as `Prefill` does and their prompt tokens into their token counts (a chunk at
    position 0 resets the row's counts first). It picks no token: a row that asks is prefilled up to
    its prompt's last token, which its first step of `ProcessingDecode` is fed (counted as a prompt
    token there) and takes the first token from, processed. The logits of every column are computed
    (the prompt's logprobs, for echo): a row that asks pays the whole bucket's lm_head.
    """

    @property
    def user_outputs(self) -> int:
        return 4

    def forward(self, input_ids, attention_mask, position_ids, row_ids, targets):
        masks, cache = self._chunk(attention_mask, position_ids, row_ids)
        scores = logprobs(self._logits(input_ids, masks, position_ids, cache, keep=0), targets, TOP_LOGPROBS)
        output_counts, prompt_seen = self.counts.tensors()
        keep = (cache.start >= 1).float()  # a prompt's first chunk starts the row's counts from zero
        rows_output = output_counts.index_select(0, row_ids) * keep
        rows_prompt = (prompt_seen.index_select(0, row_ids) * keep).scatter_add(1, input_ids, attention_mask.float())
        counts = [
            output_counts.index_copy(0, row_ids, rows_output),
            prompt_seen.index_copy(0, row_ids, rows_prompt.clamp(max=1)),
        ]
        return scores + self._commit(cache, counts)


class Copy(torch.nn.Module):
    """forward(src_row [1], dst_row [1]) -> dst_row [1, 1]: row src_row of the KV state copied whole
    into row dst_row, one fixed-shape graph over the same state as the prefill and decode graphs. It
    returns its dst_row so that a call has an output to wait for (with an aliased cache the new
    state follows, as for the other graphs)."""

    logits = False
    user_outputs = 1

    def __init__(self, cache: KVCache):
        super().__init__()
        self.cache = cache

    def output_aliases(self) -> dict[torch.nn.Parameter, int]:
        if not self.cache.aliased:
            raise ValueError("output_aliases() is for an aliased cache (NxD); this one is mutated in place")
        return {t: self.user_outputs + i for i, t in enumerate(self.cache.tensors())}

    def forward(self, src_row, dst_row):
        if self.cache.aliased:
            return (dst_row.reshape(1, 1),) + self.cache.commit(copy_rows(self.cache, src_row, dst_row))
        # in place: one row moves (torch.export records it as the same buffer mutation as a commit)
        for t in self.cache.tensors():
            t.index_copy_(0, dst_row, t.index_select(0, src_row))
        return (dst_row.reshape(1, 1),)

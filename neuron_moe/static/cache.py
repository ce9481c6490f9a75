"""The static KV cache: module state of fixed shape, one row per sequence, written per row.

State, not graph inputs: `KVCache` holds K and V of every layer, [rows, kv_heads, length,
head_dim], as registered tensors of the graphs (`static/decoder.py`), and the prefill and decode
graphs hold the one `KVCache`, so they read and write the same state. Each call updates it
functionally (an `index_copy` or a `scatter` of the old buffer) and commits the result:

- torch.export, CPU and XLA (`aliased=False`): the buffers are non-persistent (never in a
  checkpoint or a weight shard) and the commit is an in-place copy, which torch.export records as
  a buffer mutation (`graph_signature.buffers_to_mutate`), not as a graph output;
- NxD ModelBuilder v1 (`aliased=True`): the buffers are `nn.Parameter`s and the commit returns the
  new tensors as extra outputs, which `output_aliases()` maps back onto them
  (`BaseModelInstance(input_output_aliases=...)`): the runtime writes them into the parameters'
  device buffers and never hands them to the host. Every key of one builder names its state the
  same (`cache.k0`, `cache.v0`, ...), which is how the keys share one state set; NxD's state
  initializer zero-fills it on each rank.

Positions, not pad columns: row b's token at position p lives at ring index p % length of its
own row, and positions 0..p are the row's real tokens (nothing else is ever written to them), so
- global layers: length = max_cache_len, index = position;
- sliding layers: length = min(sliding_window, max_cache_len), the ring holds exactly the window
  (the query and the window - 1 positions before it) and overwrites what fell out of it; or, in the
  layout prefix caching needs (`whole_rows=True`), length = max_cache_len as in a global layer: a
  row then holds every position it has written in every layer, so the first h positions of a row
  are a prefix another row can take whole (`Copy`, decoder.py) for any h, not only the last window.
The decode mask follows from the row's position alone (`ring_positions`, and the window where a
sliding ring is longer than it), so decode takes no mask input, and the rows of a batch can sit at
different positions. A decode graph may attend over the first `span` slots of each ring only
(`GraphCache.span`; NxDI's token-generation buckets): exact while every row's position is below
span, since a row at position p < span holds its positions 0..p at indices 0..p of a ring at least
span long, and a shorter ring (a sliding layer's window) is attended whole. It writes the whole
buffer as the full-length graph does, so what it writes is the same at any position. A prefill writes whole rows
(`index_copy` on the batch dimension, by row id): the rows it does not name are not touched.
A prefill is a chunk of a prompt at positions s..s+n-1: its queries attend over the row's ring
(the positions before s that the ring still holds: none for a first chunk, s = 0) and the chunk
itself, and the row's new ring takes each index from the chunk where the chunk holds that index's
latest position, from the old ring elsewhere. What a row's slots held before its first chunk is
never read (every ring index then holds a negative position, which the masks hide), and a later
slot is written by its own chunk or decode step before anything attends to it. A row between two
chunks of its prompt sits in the decode batch with nothing to do at position s (the next chunk's
first): the one slot that writes is the next chunk's to rewrite, and no query of that chunk
attends to what it held (position s - length). A verify step (speculative decoding) writes a row's
fed token and its drafts at p..p+k before its queries attend, and keeps only the accepted ones: the
slots of the rest hold positions the row has not reached, which the masks hide until the row's next
call rewrites them, given a layout with `slack` k (`cache_layout`).

Why not transformers' StaticCache: its StaticSlidingWindowLayer branches on a Python int (how
full the window is), so an exported graph would freeze one branch — transformers' own export
recipes (integrations/executorch.py) therefore swap sliding layers for full-length ones and
pass no padding mask (batch 1) — and it keeps one length for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import Gemma4TextConfig

SLIDING = "sliding_attention"
STATE = "cache"  # the graphs' attribute, and the prefix of every state tensor's name ("cache.k0")
COUNTS = "counts"  # the logits-processing graphs' token counts (`TokenCounts`): "counts.output", "counts.prompt"


@dataclass(frozen=True)
class LayerCache:
    """Geometry of one layer's KV buffers, each [rows, kv_heads, length, head_dim]."""

    kind: str  # the HF layer type: "sliding_attention" or "full_attention"
    kv_heads: int
    head_dim: int
    length: int  # ring slots


def cache_layout(
    config: Gemma4TextConfig, max_cache_len: int, whole_rows: bool = False, slack: int = 0
) -> list[LayerCache]:
    """Per layer: global (full attention) layers have their own head_dim and KV-head count.
    `whole_rows`: sliding layers keep every position too (prefix caching), at max_cache_len slots.
    `slack`: every layer `slack` slots longer, for a graph that writes up to `slack` positions past a
    row's latest real one (speculative decoding's verify graph: its drafts, rejected or padded). A
    query then never reads such a slot: in a global layer it lies past every position the row's
    queries hold (a ring of max_cache_len + slack never wraps), in a sliding layer it is at least a
    window behind the query (the ring holds the window and the slack, and the masks keep the window)."""
    layout = []
    for i, kind in enumerate(config.layer_types):
        layer = config.per_layer_config[i]
        window = max_cache_len if whole_rows else config.sliding_window
        length = min(window, max_cache_len) if kind == SLIDING else max_cache_len
        layout.append(LayerCache(kind, layer.num_key_value_heads, layer.head_dim, length + slack))
    return layout


def cache_bytes(layout: list[LayerCache], rows: int, dtype: torch.dtype) -> int:
    """What a KVCache of `rows` rows allocates: K and V of every layer."""
    return 2 * rows * dtype.itemsize * sum(spec.kv_heads * spec.length * spec.head_dim for spec in layout)


def _register_state(module: nn.Module, name: str, zeros: torch.Tensor, aliased: bool) -> None:
    """Graph state: a parameter NxD aliases to an output (`aliased`), else a non-persistent buffer
    that torch.export records as mutated."""
    if aliased:
        module.register_parameter(name, nn.Parameter(zeros, requires_grad=False))
    else:
        module.register_buffer(name, zeros, persistent=False)


class KVCache(nn.Module):
    """K and V of every layer as module state: `k{i}`, `v{i}`, zeros at construction."""

    def __init__(self, layout: list[LayerCache], rows: int, dtype: torch.dtype, device=None, aliased: bool = False):
        super().__init__()
        self.layout, self.rows, self.aliased = layout, rows, aliased
        self.names = [f"{kv}{i}" for i in range(len(layout)) for kv in "kv"]
        for name in self.names:
            spec = layout[int(name[1:])]
            zeros = torch.zeros(rows, spec.kv_heads, spec.length, spec.head_dim, dtype=dtype, device=device)
            _register_state(self, name, zeros, aliased)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.names]

    def commit(self, new: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Make `new` (in `names` order) the state: in place, or returned as the aliased outputs."""
        if self.aliased:
            return tuple(new)
        for old, value in zip(self.tensors(), new):
            old.copy_(value)
        return ()


class TokenCounts(nn.Module):
    """Per row, the token counts the penalties read (`sampling.process`), as module state of the
    logits-processing graphs only (their prefill and decode variants hold the one `TokenCounts`, as
    every graph holds the one `KVCache`): `output` [rows, V], how often each token was generated,
    and `prompt` [rows, V], 1 where the row's prompt holds the token. Zeros at construction; a row is
    reset by its first prefill chunk (a chunk at position 0) or its first decode step when it had
    no prefill. fp32, so the penalties need no cast; committed as `KVCache` commits."""

    def __init__(self, rows: int, vocab: int, device=None, aliased: bool = False):
        super().__init__()
        self.rows, self.vocab, self.aliased = rows, vocab, aliased
        self.names = ["output", "prompt"]
        for name in self.names:
            _register_state(self, name, torch.zeros(rows, vocab, device=device), aliased)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.names]

    commit = KVCache.commit


def ring_positions(last: torch.Tensor, length: int) -> torch.Tensor:
    """[R] a row's latest position -> [R, length]: the position each ring index holds, the latest
    q <= last with q = index (mod length); negative where no position has reached that index yet."""
    last = last.reshape(-1, 1)
    return last - torch.remainder(last - torch.arange(length, device=last.device), length)


class GraphCache:
    """What HF's attention layers call: `update(key, value, layer_idx)` -> the K/V to attend over.

    Prefill (`rows` given, and each row's first position `start` [P, 1]): attention runs over the
    row's ring then the bucket's own K/V (`chunk_mask` handles the pads and what the ring holds);
    each layer's new state is the old one with the prefilled rows' rings updated from the bucket.
    Decode: each row's K/V is scattered into index position % length of its own row and attention
    runs over the ring's first `attended(length, span)` indices (`span` None: the whole ring). The
    new state of every layer is collected in `new`.
    """

    def __init__(
        self,
        state: KVCache,
        positions: torch.Tensor,
        rows: torch.Tensor | None = None,
        start: torch.Tensor | None = None,
        span: int | None = None,
    ):
        self.state, self.positions, self.rows, self.start, self.span = state, positions, rows, start, span
        self.new: list[torch.Tensor | None] = [None] * len(state.names)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        old = self.state.tensors()[2 * layer_idx : 2 * layer_idx + 2]
        new, attend = self.write(old, key, value, self.state.layout[layer_idx].length)
        self.new[2 * layer_idx], self.new[2 * layer_idx + 1] = new
        return attend

    def write(self, old: list[torch.Tensor], key: torch.Tensor, value: torch.Tensor, length: int):
        """One layer's [K, V] state `old` with this call's K/V written -> (the new [K, V], the K/V to
        attend over)."""
        if self.rows is not None:
            held, index = _bucket_columns(self.positions, length)
            rings = [o.index_select(0, self.rows) for o in old]
            from_chunk = (held >= self.start)[:, None, :, None]
            new = [
                o.index_copy(0, self.rows, torch.where(from_chunk, _gather_seq(t, index), ring))
                for o, t, ring in zip(old, (key, value), rings)
            ]
            attend = tuple(torch.cat([ring, t], dim=2) for ring, t in zip(rings, (key, value)))
        else:
            index = torch.remainder(self.positions, length)  # [B, 1]
            new = [o.scatter(2, _expand(index, t), t) for o, t in zip(old, (key, value))]
            attend = [n[:, :, : attended(length, self.span)] for n in new]
        return new, attend


def attended(length: int, span: int | None) -> int:
    """The ring indices a decode graph of `span` positions attends over in a ring of `length`: the
    first span, or the whole ring where it is shorter (None: the whole ring)."""
    return length if span is None else min(length, span)


def _expand(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[R, S] sequence indices -> the [R, heads, S, head_dim] index a gather/scatter on dim 2 takes."""
    return index[:, None, :, None].expand(like.shape[0], like.shape[1], index.shape[1], like.shape[3])


def _gather_seq(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return states.gather(2, _expand(index, states))


def _bucket_columns(positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded bucket's positions [R, bucket] -> ([R, length] the position each ring index
    holds after the chunk, [R, length] the bucket column it sits in: meaningful where that position
    is the chunk's; clamped to column 0 elsewhere, where the old ring's value is kept or, before
    any position reaches that index, the masks hide it)."""
    bucket = positions.shape[1]
    last = positions[:, -1:]  # the last column is every row's last token of the chunk
    held = ring_positions(last, length)
    return held, (held + (bucket - 1 - last)).clamp(min=0)  # position q sits in column q - last + bucket - 1


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean [B, Q, K] -> HF eager attention's additive mask [B, 1, Q, K]."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)[
        :, None
    ]


def chunk_mask(
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    start: torch.Tensor,
    window: int | None,
    length: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A chunk's queries [P, bucket] against the row's ring of `length` indices, then the bucket
    ([P, 1, bucket, length + bucket]): a ring index is visible if it holds a position before the
    chunk's `start` (and, in a sliding layer, within the query's window); a bucket column if it is
    a real token at most the query's position (and within the window). Causal by construction:
    everything in the ring comes before every token of the chunk."""
    slots = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    dist = slots[:, None] - slots[None, :]  # query column - key column
    allowed = dist >= 0
    if window is not None:
        allowed = allowed & (dist < window)
    own = allowed[None] & attention_mask.bool()[:, None, :]
    held = ring_positions(start - 1, length)[:, None, :]  # [P, 1, length]; negative: nothing yet
    ring = held >= 0
    if window is not None:
        ring = ring & (positions[:, :, None] - held < window)
    else:
        ring = ring.expand(-1, positions.shape[1], -1)
    return _additive(torch.cat([ring, own], dim=-1), dtype)


def decode_mask(positions: torch.Tensor, length: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Each row's queries at their positions ([B, S]: a decode step's one, a verify step's S in a row)
    against its ring of `length` indices ([B, 1, S, length]): an index is visible if it holds a
    position (>= 0) at most the query's, which is then a real one of that row; a ring of at most the
    window's length is the window itself, a longer one (a sliding layer in the whole-row layout, or
    with slack) also hides what lies `window` or more before the query. A verify step writes its S
    positions before attending: for its earlier queries an index holding a later one of them reads as
    that position less `length`, hidden (negative, or a window behind: `cache_layout`'s slack)."""
    held = ring_positions(positions, length).view(*positions.shape, length)
    visible = held >= 0
    if window is not None and length > window:
        visible = visible & (positions[..., None] - held < window)
    return _additive(visible, dtype)


def copy_rows(state: KVCache, src_row: torch.Tensor, dst_row: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's K and V with row `dst_row` [1] replaced by row `src_row` [1], whole: what the
    destination then reads of it is positions 0..h-1, the prefix it shares (its next chunk starts at
    h, and `chunk_mask` hides every index at or after it until its own chunks and steps write them).
    Exact for any h only in the whole-row layout: a window-long ring holds the source's last window."""
    return [t.index_copy(0, dst_row, t.index_select(0, src_row)) for t in state.tensors()]


def state_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The state of a graph (a module, or an exported program's module) by name: its KV cache
    (`cache.k0`, ...) and, in a logits-processing graph, its token counts (`counts.output`, ...)."""
    found = {
        name: t
        for name, t in [*module.named_buffers(), *module.named_parameters()]
        if name.startswith((STATE + ".", COUNTS + "."))
    }
    if not found:
        raise ValueError(f"{type(module).__name__} holds no KV state ({STATE}.*)")
    return found


def share_state(modules, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Make every module's state (buffers: the torch.export form) the same tensors: `state`, or
    (None) fresh zeros shaped as the modules' — what NxD's state initializer does on each rank — and
    grown by the state of a module that holds more (the logits-processing graphs' token counts).
    Returns the state.

    Exported programs each hold their own copy of the buffers once they are saved and loaded, or
    moved to a device; a graph only shares state with the graphs bound to it here.
    """
    modules = list(modules)
    state = dict(state or {})
    for module in modules:
        for name, t in state_tensors(module).items():
            # made on the host and sent: on a lazy device (XLA) zeros made there would be a graph
            state.setdefault(name, torch.zeros(t.shape, dtype=t.dtype).to(t.device))
    for module in modules:
        mine = state_tensors(module)
        if any((t.shape, t.dtype) != (state[n].shape, state[n].dtype) for n, t in mine.items()):
            raise ValueError(f"{type(module).__name__}: its state does not match the shared one")
        for name in mine:
            tensor = state[name]
            owner, attr = name.rsplit(".", 1)
            module.get_submodule(owner).register_buffer(attr, tensor, persistent=False)
    return state

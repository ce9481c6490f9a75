"""Prefix caching over the static graphs' rows: what each row of the KV cache holds, by block.

A row holds the tokens whose K/V it has written at positions 0..n-1: its prompt as it is
prefilled, then each token fed back to it. Whole blocks of `block` tokens are named by a chain of
hashes, each over its parent's hash and its own tokens (as vLLM names its KV blocks), so equal
hashes at block i mean equal tokens 0..(i+1)*block-1. A prompt's lookup walks its blocks through
that chain and finds the row holding the longest run of them; the request then takes that prefix
instead of prefilling it, and prefills the rest from there (a chunk whose start is the hit). It
goes into the least recently used free row (an empty one before any holding a prefix): the prefix
is copied there (`decoder.Copy`, one graph call) unless that row is the one holding it. So a
request never destroys a more recently used prefix than the one it evicts, and the row it took a
prefix from counts as used. At most len(prompt) - 1 tokens are taken, so the prompt's last token is always prefilled and
its logits give the first token (vLLM's rule too), and only whole blocks.

A row whose request ended keeps what it holds: it is free for admission, and its prefix is there
for whichever request wants it until the row is taken (least recently used first). A free row
waits in the decode batch at the position after what it holds, so the pad it writes there each
step touches nothing held (at most max_cache_len - 1 positions are kept: a row filled to the last
position waits at that one).

Exact in the whole-row layout only (`cache.cache_layout(..., whole_rows=True)`), where a sliding
layer keeps every position as a global one does: a window-long ring would hold only the last
window of the source row, not the window before the hit.

Counted as vLLM counts them (`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`): per request
looked up, its prompt's tokens queried and the tokens it took from a row hit.
"""

from __future__ import annotations

import itertools

BLOCK = 16  # tokens per hashed block (vLLM's default block size)


class PrefixIndex:
    """The tokens each of `rows` rows holds, their blocks' chained hashes, and when each row was
    last used; `max_cache_len`: the cache's positions per row."""

    def __init__(self, rows: int, max_cache_len: int, block: int = BLOCK):
        if block < 1:
            raise ValueError(f"block must be at least 1 token, got {block}")
        self.block, self.max_cache_len = block, max_cache_len
        self.tokens: list[list[int]] = [[] for _ in range(rows)]  # what row r holds at positions 0..n-1
        self._hashes: list[list[int]] = [[] for _ in range(rows)]  # the chain hash of each whole block
        self._rows: dict[int, set[int]] = {}  # block hash -> the rows holding that block (and all before it)
        self._used = [0] * rows  # when each row was last admitted into or freed: 0 never
        self._clock = itertools.count(1)
        self.queries = self.hits = 0  # tokens, as vLLM counts them

    def lookup(self, prompt: list[int], free: list[int]) -> tuple[int | None, int]:
        """(the row holding the longest whole-block prefix of `prompt`, of at most len(prompt) - 1
        tokens, its length); a free one of those first, else the most recently used; (None, 0) if
        none. Counts the query and its hit."""
        holders, hit = self._holders(prompt)
        found = None
        if holders:
            free_set = set(free)
            found = max(holders, key=lambda r: (r in free_set, self._used[r]))
            if self.tokens[found][:hit] != prompt[:hit]:  # a hash collision: take nothing rather than wrong K/V
                found, hit = None, 0
        self.queries += len(prompt)
        self.hits += hit
        return found, hit

    def held(self, prompt: list[int]) -> int:
        """The length of `prompt`'s longest whole-block prefix of at most len(prompt) - 1 tokens that
        some row holds (as `lookup` finds it, uncounted)."""
        return self._holders(prompt)[1]

    def _holders(self, prompt: list[int]) -> tuple[set[int] | None, int]:
        """(the rows holding `prompt`'s longest takeable whole-block prefix, its length) by the hashes."""
        holders, blocks, parent = None, 0, None
        for i in range((len(prompt) - 1) // self.block if prompt else 0):
            parent = _chain(parent, prompt[i * self.block : (i + 1) * self.block])
            rows = self._rows.get(parent)
            if not rows:
                break
            holders, blocks = rows, i + 1
        return holders, blocks * self.block

    def victim(self, free: list[int]) -> int:
        """The free row a request goes into: the least recently used (an empty one first)."""
        return min(free, key=self._used.__getitem__)

    def admit(self, row: int, source: int | None, hit: int) -> None:
        """A request took `row` holding the first `hit` tokens of `source`'s (itself, or copied)."""
        tokens = self.tokens[source][:hit] if source is not None else []
        self._truncate(row, 0)
        self.extend(row, tokens)
        self._used[row] = next(self._clock)
        if source is not None:
            self._used[source] = next(self._clock)

    def extend(self, row: int, ids: list[int]) -> None:
        """Row `row` wrote `ids` at its next positions."""
        tokens, hashes = self.tokens[row], self._hashes[row]
        tokens.extend(ids)
        while (len(hashes) + 1) * self.block <= len(tokens):
            i = len(hashes)
            hashes.append(_chain(hashes[-1] if hashes else None, tokens[i * self.block : (i + 1) * self.block]))
            self._rows.setdefault(hashes[-1], set()).add(row)

    def park(self, row: int, error: Exception | None = None) -> int:
        """Row `row` is free: what it holds stays (nothing if its work failed), at most max_cache_len - 1
        tokens; the position it waits at in the decode batch (the one after what it holds)."""
        self._truncate(row, 0 if error is not None else min(len(self.tokens[row]), self.max_cache_len - 1))
        self._used[row] = 0 if error is not None else next(self._clock)
        return len(self.tokens[row])

    def _truncate(self, row: int, n: int) -> None:
        hashes = self._hashes[row]
        while len(hashes) * self.block > n:
            dropped = hashes.pop()
            held = self._rows[dropped]
            held.discard(row)
            if not held:
                del self._rows[dropped]
        del self.tokens[row][n:]


def _chain(parent: int | None, block: list[int]) -> int:
    """A block's hash: its parent's and its own tokens (vLLM's hash_block_tokens, Python's hash)."""
    return hash((parent, tuple(block)))

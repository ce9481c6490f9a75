"""The engine step over the static graphs' rows (static/rows.py), on a runtime that records its
calls: which chunks each prefill call takes, what each decode step feeds at which positions, and
how a row passes from one piece of work to the next. (Over the real graphs: test_serve_batching.py
serves through it, test_reader_batch.py evaluates through it.)"""

import pytest
import torch

from neuron_moe.run_config import Shapes
from neuron_moe.greedy import left_pad
from neuron_moe.static.rows import Chunk, GraphRuntime, Rows, generate, prefill_row
from neuron_moe.static.sampling import GREEDY

SAMPLED = (0.5, 0.0, 1.0, 0.25)


class Runtime:
    """Two rows, chunks of 4, up to 2 chunks a call; a prefill's token is 100 + its row, a decode
    step's 1000 + the position it ran at."""

    batch, pad_id, chunk, prefill_rows = 2, 0, 4, [1, 2]

    def __init__(self, fail_decode=False):
        self.calls, self.fail_decode = [], fail_decode

    def prefill(self, chunks):
        self.calls.append(("prefill", [(c.ids, c.start, c.row, c.sampling) for c in chunks]))
        return torch.tensor([100 + c.row for c in chunks]), None

    def decode(self, ids, positions, sampling):
        sampled = [tuple(r) for r in sampling.tolist()]
        self.calls.append(("decode", ids[:, 0].tolist(), positions[:, 0].tolist(), sampled))
        if self.fail_decode:
            raise RuntimeError("device fault")
        return positions[:, 0] + 1000, None


class Work:
    """Takes `n` tokens, feeding back each one (its first input `first` if its prompt is empty)."""

    def __init__(self, prompt, n, first=None):
        self.prompt, self.n, self.first = prompt, n, first
        self.got, self.ended = [], None

    def sampling(self):
        return SAMPLED

    def next(self, token, logits):
        self.got.append(token)
        if len(self.got) == self.n:
            return None
        return self.first if token is None else token

    def end(self, error=None):
        self.ended = error or "done"


def run(rows, waiting):
    take = lambda: waiting.pop(0) if waiting else None  # noqa: E731
    while waiting or rows.active():
        rows.step(take)


def test_rows_prefill_in_chunks_oldest_first_and_decode_each_row_at_its_own_position():
    runtime, counted = Runtime(), []
    rows = Rows(runtime)
    rows.counted = lambda graph, n: counted.append((graph, n))
    long, empty, short = Work([1, 2, 3, 4, 5], 2), Work([], 2, first=42), Work([7, 8], 1)
    run(rows, [long, empty, short])
    assert runtime.calls == [
        # the long prompt's first chunk; the empty prompt decodes at once, the long one sits as a pad
        # at its next prefill position
        ("prefill", [([1, 2, 3, 4], 0, 0, GREEDY)]),
        ("decode", [0, 42], [4, 0], [GREEDY, SAMPLED]),
        # the empty one ended; the short one took its row and is prefilled with the long one's last
        # chunk, in one call, each sampled as it asks for its first token
        ("prefill", [([5], 4, 0, SAMPLED), ([7, 8], 0, 1, SAMPLED)]),
        ("decode", [100, 0], [5, 0], [SAMPLED, GREEDY]),
    ]
    assert (long.got, empty.got, short.got) == ([100, 1005], [None, 1000], [101])
    assert [w.ended for w in (long, empty, short)] == ["done"] * 3
    assert counted == [("prefill", 1), ("decode", 1), ("prefill", 2), ("decode", 1)] and rows.steps == 2
    assert rows.slots == [None, None] and rows.ids.tolist() == [[0], [0]] and rows.positions.tolist() == [[0], [0]]


def test_a_failed_graph_call_ends_the_work_it_ran_frees_its_rows_and_raises():
    rows = Rows(Runtime(fail_decode=True))
    first, second, waiting = Work([1], 3), Work([2, 3], 3), Work([4], 1)
    queue = [first, second]
    with pytest.raises(RuntimeError, match="device fault"):
        rows.step(lambda: queue.pop(0) if queue else None)
    assert str(first.ended) == str(second.ended) == "device fault" and rows.slots == [None, None]
    assert rows.steps == 0
    rows.runtime.fail_decode = False  # the rows serve the next piece of work
    run(rows, [waiting])
    assert waiting.got == [100] and waiting.ended == "done"


def test_prefill_all_prefills_every_prompt_in_its_first_step_a_call_each_at_its_own_bucket():
    """`generate`'s schedule (validate, the TP ranks): every prompt prefilled before the first decode,
    on graphs of one row, each chunk in the smallest bucket that holds it (no buckets: its own length)."""
    for buckets, widths in (([2, 4, 8], [4, 2, 8]), (None, [3, 1, 5])):
        calls = []

        def prefill(ids, mask, positions, row_ids, sampling):
            calls.append(("prefill", ids.shape, ids[0, -1].item(), positions[0, -1].item(), row_ids.tolist()))
            return (100 + row_ids[:, None],)

        def decode(ids, positions, sampling):
            calls.append(("decode", ids[:, 0].tolist(), positions[:, 0].tolist()))
            return (1000 + positions,)

        runtime = GraphRuntime(prefill, decode, Shapes(batch_size=3, buckets=buckets, prefill_chunk=8), pad_id=0)
        got = generate(runtime, *left_pad([[1, 2, 3], [4], [5, 6, 7, 8, 9]], 0), 2)
        assert calls == [
            ("prefill", (1, widths[0]), 3, 2, [0]),
            ("prefill", (1, widths[1]), 4, 0, [1]),
            ("prefill", (1, widths[2]), 9, 4, [2]),
            ("decode", [100, 101, 102], [3, 1, 5]),
        ]
        assert got[0].tolist() == [[100, 1003], [101, 1001], [102, 1005]] and got[1] is None


def test_a_prefill_calls_inputs_are_each_chunk_left_padded_in_its_bucket_rows_padded_with_the_last():
    """One tensor per input, row i that `prefill_row` makes for chunk i (pads at the chunk's first
    position), the call's rows made up to a compiled row count with copies of the last chunk."""
    got = []

    def prefill(*inputs):
        got.append(inputs)
        return (inputs[3][:, None],)

    runtime = GraphRuntime(
        prefill, None, Shapes(batch_size=4, buckets=(4, 8), prefill_rows=(1, 4), prefill_chunk=8), pad_id=7
    )
    chunks = [Chunk([1, 2, 3], 0, 2, GREEDY), Chunk([4, 5, 6, 7, 8], 8, 0, SAMPLED), Chunk([9], 3, 3, GREEDY)]
    tokens, logits = runtime.prefill(chunks)
    assert tokens.tolist() == [2, 0, 3] and logits is None
    ids, mask, positions, rows, sampling = got[0]
    padded = [*chunks, chunks[-1]]
    want = [torch.cat(column) for column in zip(*(prefill_row(torch.tensor(c.ids), 8, 7, c.start) for c in padded))]
    for tensor, expected in zip((ids, mask, positions), want):
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected)
    assert rows.tolist() == [2, 0, 3, 3] and torch.equal(sampling, torch.tensor([c.sampling for c in padded]))

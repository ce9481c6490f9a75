"""The engine: one step loop, in its own thread, over the rows of a runtime with `static/rows.py`'s
protocol, whichever runs the model: the static graphs on CPU (`static/runtime.py`), a compiled Neuron
artifact (`neuron.py`) or transformers' model (`hf_runtime.py`). Every backend `serve` offers runs here.

Before a request runs, `Engine` checks what it asks against the runtime (its context, its candidate
width, its logits-processing variants: `check_sampling`, `max_tokens_for`), compiles its grammar and
makes its `decoding.Output`; a request it cannot serve is a RequestError naming the field.

A request waits until a row is free, then joins: its prompt is prefilled into that row (the graph
writes that row of the cache only, `static/rows.py`), and its first token, which the prefill graph
chose, is sent at once. Each turn of the loop is one engine step (`static.rows.Rows.step`): at
most one prefill call and then one decode step of every row that is generating (batched and
chunked prefill, every row at its own position): a request that joins while others wait is
prefilled together with them, in one call, and a long prompt costs the rows generating beside it
one chunk's call per token, not its whole prefill. A row ends — EOS, a stop string, max_tokens
(at most the end of the cache), or its client went away — and is free for the next waiting request.

Host work and graph calls overlap (vLLM's async scheduling is the model): between two graph calls
the loop does only what the next call needs, from the token ids — each row's token taken by its
request's id side (`decoding.Output.take`: EOS and max_tokens end a request there, and its row is
free that same turn), the next inputs written in place (`Rows`) and admission. Each token's text
(`Output.text`: detokenizing, stop strings, held-back text) and the sink's calls run on a second
thread, the text thread (`_Texts`), while the loop is in the next graph call, whose GIL-free time
(a CPU graph's ops, a Neuron call) they fill. The text thread is at most a step behind: before a
step the loop waits for the text of the steps before the previous one. So a request that a stop
string ends is seen ended a step late, and its row decodes one token too many, which is dropped:
harmless, as that step writes one slot of the row's own cache, and what a row held before its next
request's first chunk is never read (`static/cache.py`); the id side still bounds the row by the
request's max_tokens.

Prefix caching (a runtime with a copy graph, `static/prefix.py`): a row whose request ended keeps
what its cache holds; a request whose prompt begins with a prefix some row holds (whole blocks)
takes that row if it is free, or has the prefix copied into the row it takes, and prefills only
the rest. The lookups and hits are counted into /metrics as vLLM counts them.

Speculative decoding (a runtime with a verify graph, `--speculative-config`): a step drafts tokens for
each row and checks them in one verify call (`Rows`), a row taking several tokens a step, each
through its request's id side as above; the drafts and the accepted ones are counted into /metrics
as vLLM counts them.

Sampling happens in the graphs (`static/sampling.py`): each row's sampling input carries its
request's temperature, top-k, top-p and a uniform draw from the request's own seeded generator
(`decoding.Output.sampling`), so a seeded request gets the same tokens whatever runs beside it.
Per row, everything else is decoding.py's `Output`: stop strings, held-back text and UTF-8 are
handled as for a request served alone.

A request comes with a sink (`scheduler.Job`) that the text thread calls, in order: `put(step)`
for each Step, `fail(error)`, and `end()` exactly once when the request is over; the loop reads
`sink.cancelled` (an Event) at every step. `generate` wraps that in a blocking iterator. A failure
in one row's work (its text, its sink) ends that request with the error and leaves the other rows
running; a graph call that fails ends the requests it was running (the prefilled ones, or every
generating row); the loop itself goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..static.prefix import PrefixIndex
from ..static.rows import Rows
from ..static.sampling import BIAS_WIDTH, NOTHING, Processing
from .decoding import Output, RequestError, SamplingParams, Step, allowed_mask, bad_word_ids, ends
from .grammar import GrammarError, Grammars

log = logging.getLogger("neuron_moe.serve")
_END = object()


@dataclass
class _Request:
    """A request in a row of the batch (the work a `Rows` runs): its Output's id side here, on the
    step loop's thread; its text and its sink on the text thread (`_Texts`)."""

    prompt: list[int]
    output: Output
    sink: object  # put(step), fail(error), end(), cancelled: threading.Event
    texts: _Texts
    error: Exception | None = None  # its own failure, sent to its sink at its end
    done: bool = False  # its text side ended it (a stop string, its sink failed): the loop frees its row
    complete: bool = False  # its last Step went out: a failure after it is past its end

    def sampling(self) -> tuple[float, float, float, float]:
        return self.output.sampling()

    @property
    def asks(self) -> bool:
        return self.output.asks

    def processing(self):
        return self.output.processing()

    @property
    def matcher(self):
        return self.output.matcher

    def prompt_scores(self, start: int, *scores) -> None:
        self.output.prompt_scores(start, *scores)

    def next(self, token: int, logits: torch.Tensor | None, scores=None) -> int | None:
        """The token the graph chose (with its scores from the logits-processing graphs), taken by the
        ids (EOS, max_tokens, non-finite logits end the request here) and its text handed to the text
        thread -> the token to feed next, or None."""
        try:
            finish = self.output.take(token, scores)
        except RequestError as e:  # what the request asked admits no token: the client's 400, one line
            log.warning("a request ended: %s", e)
            self.error = e
            return None
        except Exception as e:  # this request's own failure: the other rows go on
            log.exception("generation failed in a row of the batch")
            self.error = e
            return None
        self.texts.put(self, self.output.count, finish)
        return None if finish else token

    def end(self, error: Exception | None = None) -> None:
        self.texts.end(self, error)


class _Texts:
    """The text side of the batch's requests, on a thread of its own: each token's Step
    (`Output.text`: detokenizing, stop strings, held-back text) and the sink's calls, in the order
    the step loop hands them over, while the loop goes on to the next graph call. A request that a
    stop string ends, or whose sink fails, is marked `done`; the loop frees its row when it next
    looks (`wait` bounds how far behind this side may be). Anything of a request after its end is
    dropped."""

    def __init__(self):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._handled = threading.Condition()
        self.queued = self.handled = 0  # items handed over (by the step loop) and handled (here)
        self._thread = threading.Thread(target=self._run, name="batch-text", daemon=True)
        self._thread.start()

    def put(self, request: _Request, count: int, finish: str | None) -> None:
        """From the step loop: the count-th token of `request`, whose id side said `finish`."""
        self.queued += 1
        self._items.put((request, count, finish))

    def end(self, request: _Request, error: Exception | None) -> None:
        """From the step loop: `request` is over (`error`: what it failed with), after its tokens."""
        self.queued += 1
        self._items.put((request, _END, error))

    def wait(self, mark: int) -> None:
        """Until the first `mark` items handed over are handled."""
        if self.handled < mark:
            with self._handled:
                self._handled.wait_for(lambda: self.handled >= mark)

    def close(self) -> None:
        """Once everything handed over is handled, end the thread."""
        self._items.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._items.get()) is not None:
            try:
                self._handle(*item)
            finally:
                with self._handled:
                    self.handled += 1
                    self._handled.notify()

    def _handle(self, request: _Request, count, finish) -> None:
        if count is _END:  # `finish` is the error it failed with
            error = None if request.complete else finish or request.error
            try:
                if error is not None:
                    request.sink.fail(error)
                request.sink.end()
            except Exception:
                log.exception("a request's end failed")
            return
        if request.done:  # a stop string ended it a step before its row was freed: this token is past the end
            return
        try:
            step = request.output.text(count, finish)
            request.sink.put(step)
        except Exception as e:  # this request's own failure: the other rows go on
            log.exception("generation failed in a row of the batch")
            request.error, request.done = e, True
            return
        request.done = request.complete = step.finish_reason is not None


class _QueueSink:
    """Steps for a thread that blocks on them (`Engine.generate`)."""

    def __init__(self, cancelled: threading.Event):
        self.cancelled, self.items = cancelled, queue.SimpleQueue()
        self.put = self.fail = self.items.put

    def end(self) -> None:
        self.items.put(_END)


class Engine:
    """The engine over a runtime with Rows' protocol (the static graphs on CPU, a Neuron artifact,
    transformers' model: `hf_runtime.py`): what a request may ask of it (its limits, its sampling),
    checked before it runs, and its Output; its `batch` rows are this engine's `rows`, and `step()` its
    one step, which its loop thread runs while there is work."""

    def __init__(self, runtime, tokenizer, eos_ids: set[int]):
        self.runtime, self.tokenizer = runtime, tokenizer
        # prompt + generated tokens. Any prompt that fits the cache: a prompt longer than the chunk is
        # prefilled a chunk at a time. A prompt of n tokens takes positions 0..n-1 and each new token but
        # the last the next one: n + max_tokens - 1 <= max_cache_len, so n + max_tokens <= max_context.
        self.max_context = runtime.max_cache_len + 1
        self.eos_ids = frozenset(eos_ids)
        # the most top_k the runtime samples from exactly (its graphs' candidate width; None: any)
        self.max_top_k: int | None = getattr(runtime, "candidates", None)
        # structured output's grammars, their bitmasks as wide as the runtime's logits (`vocab`; else the
        # tokenizer's vocabulary)
        self.grammars = Grammars(tokenizer, getattr(runtime, "vocab", None), self.eos_ids)
        self.rows = runtime.batch
        prefix = (
            PrefixIndex(runtime.batch, runtime.max_cache_len) if getattr(runtime, "prefix_caching", False) else None
        )
        self.batch = Rows(runtime, prefix=prefix)  # the request in each row
        self.batch.counted = self._counted
        self.batch.looked_up = self._looked_up
        self.batch.verified = self._verified
        self.metrics = None  # a metrics.Metrics, once a server counts this engine's calls
        self._waiting: deque[_Request] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._texts = _Texts()
        self._thread = threading.Thread(target=self._loop, name="batch-step", daemon=True)
        self._thread.start()

    @property
    def slots(self) -> list[_Request | None]:
        return self.batch.slots

    @property
    def steps(self) -> int:
        """Decode steps run."""
        return self.batch.steps

    # ---- what a request may ask ----------------------------------------------------------------------

    @property
    def vocab(self) -> int | None:
        """The logits' width: the runtime's vocabulary, else the tokenizer's (None: unknown)."""
        runtime = getattr(self.runtime, "vocab", None) or getattr(self, "vocab_size", None)
        return runtime or self.grammars.vocab_size or getattr(self.tokenizer, "vocab_size", None)

    def check_sampling(self, params: SamplingParams) -> None:
        """A RequestError if the runtime cannot sample this request as asked."""
        if self.max_top_k is not None and params.top_k > self.max_top_k:
            raise RequestError(
                f"this backend's graphs sample among the {self.max_top_k} most likely tokens: top_k "
                f"must be at most {self.max_top_k} (or 0, off), got {params.top_k}",
                "top_k",
            )
        processing = params.processing
        if len(processing.logit_bias) > BIAS_WIDTH:
            raise RequestError(
                f"logit_bias: at most {BIAS_WIDTH} entries (the graphs' fixed width per row), got "
                f"{len(processing.logit_bias)}",
                "logit_bias",
            )
        vocab = self.vocab
        bad = next((t for t, _ in processing.logit_bias if vocab is not None and t >= vocab), None)
        if bad is not None:
            raise RequestError(f"logit_bias: token id {bad} is not below the vocabulary size {vocab}", "logit_bias")
        if params.min_tokens > params.max_tokens:
            raise RequestError(
                f"min_tokens ({params.min_tokens}) must be at most max_tokens ({params.max_tokens})", "min_tokens"
            )
        banned = ends(params, self.eos_ids) if params.min_tokens else ()
        if len(processing.logit_bias) + len(banned) > BIAS_WIDTH:
            raise RequestError(
                f"stop_token_ids: with min_tokens, the ids banned until then (EOS and these: {len(banned)}) and "
                f"logit_bias ({len(processing.logit_bias)}) are at most {BIAS_WIDTH} (the graphs' fixed width per row)",
                "stop_token_ids",
            )
        if params.allowed_token_ids is not None:
            bad = next((t for t in params.allowed_token_ids if vocab is not None and t >= vocab), None)
            if bad is not None:
                raise RequestError(
                    f"allowed_token_ids: token id {bad} is not below the vocabulary size {vocab}", "allowed_token_ids"
                )
        words = bad_word_ids(self.tokenizer, params.bad_words, vocab)
        if len(processing.logit_bias) + len(banned) + len(words) > BIAS_WIDTH:
            raise RequestError(
                f"bad_words: their token sequences ({len(words)}: each word with and without a leading space), "
                f"logit_bias ({len(processing.logit_bias)}) and the ids min_tokens bans ({len(banned)}) are at "
                f"most {BIAS_WIDTH} (the graphs' fixed width of banned ids per row)",
                "bad_words",
            )
        asked = next(
            (
                field
                for field, asks in (
                    ("min_tokens", banned),
                    ("best_of", params.rank),
                    ("allowed_token_ids", params.allowed_token_ids is not None),
                    ("bad_words", params.bad_words),
                )
                if asks
            ),
            None,
        )
        if (processing.asks or asked) and getattr(self.runtime, "processing", True) is False:
            field = _asked_field(processing) if processing.asks else asked
            raise RequestError(
                f"{field}: this backend's graphs have no logits-processing variant (an artifact built "
                "before it); serve it with --backend static or hf, or rebuild the artifact",
                field,
            )
        if params.grammar is not None and getattr(self.runtime, "processing", True) is False:
            field = params.grammar.field
            raise RequestError(
                f"{field}: this backend's graphs have no logits-processing variant to take a grammar's token mask "
                "(an artifact built before it); serve it with --backend static or hf, or rebuild the artifact",
                field,
            )

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar into the cache (slow for a large schema: a caller off the step
        loop's thread calls this first); a RequestError naming its field if it does not compile."""
        if params.grammar is not None:
            try:
                self.grammars.compile(params.grammar)
            except GrammarError as e:
                raise RequestError(str(e), e.field) from None

    def max_tokens_for(self, n_prompt: int, requested: int | None) -> int:
        """The request's token budget: what it asked for, or what is left of the context (a request
        that runs to the end of the cache ends with "length")."""
        if n_prompt < 1:  # a tokenizer that adds no BOS, and an empty prompt: nothing to prefill
            raise RequestError("the prompt has no tokens", "prompt")
        room = self.max_context - n_prompt
        if room < 1:
            raise RequestError(
                f"the prompt is {n_prompt} tokens; this model's context is {self.max_context} "
                f"tokens, which leaves no room to generate",
                "prompt",
            )
        if requested is None:
            return room
        if requested > room:
            raise RequestError(
                f"this model's context is {self.max_context} tokens: the prompt ({n_prompt}) "
                f"plus max_tokens ({requested}) exceeds it by {requested - room}",
                "max_tokens",
            )
        return requested

    def output(self, params: SamplingParams, prompt: list[int] = ()) -> Output:
        """A new request's Output; a RequestError if the runtime cannot sample it or its grammar does
        not compile."""
        self.check_sampling(params)
        self.compile_grammar(params)
        matcher = None if params.grammar is None else self.grammars.matcher(params.grammar)
        vocab = self.vocab
        allowed = None if params.allowed_token_ids is None else allowed_mask(params.allowed_token_ids, vocab)
        words = bad_word_ids(self.tokenizer, params.bad_words, vocab)
        return Output(self.tokenizer, self.eos_ids, params, prompt, matcher, allowed, words)

    # ---- requests in ------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink) -> None:
        """Queue a request; its Steps go to `sink` from the loop's thread. A RequestError, before
        anything runs, if the prompt or the budget does not fit the graphs or the sampling cannot
        be served."""
        self.max_tokens_for(len(prompt_ids), params.max_tokens)
        request = _Request(list(prompt_ids), self.output(params, prompt_ids), sink, self._texts)
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._waiting.append(request)
            self._wake.notify()

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, cancelled: threading.Event | None = None
    ) -> Iterator[Step]:
        """One Step per generated token, the last with the finish reason, for a caller that blocks on
        them: the Steps come from the loop's thread. A consumer that stops reading (or sets
        `cancelled`: then no Step follows, not even a final one) frees its row."""
        sink = _QueueSink(cancelled or threading.Event())
        self.submit(prompt_ids, params, sink)
        try:
            while (item := sink.items.get()) is not _END and not sink.cancelled.is_set():
                if isinstance(item, BaseException):
                    raise item
                yield item
        except GeneratorExit:  # closed (or dropped) by its consumer before the end
            sink.cancelled.set()
            raise

    def load(self) -> tuple[int, int, int, int]:
        """(requests running, waiting, rows, rows in use), for /metrics."""
        in_use = sum(request is not None for request in self.batch.slots)
        return in_use, len(self._waiting) + (self.batch.held is not None), self.rows, in_use

    def close(self) -> None:
        """Stop the loop; requests still waiting or running end without a final Step."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *_) -> None:
        self.close()

    # ---- the step loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        batch, texts = self.batch, self._texts
        mark = 0  # the items handed to the text thread before the previous step
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not batch.active() and batch.held is None:
                    self._wake.wait()
                if self._closed:
                    break
            mark = self.step(mark)
        for row in batch.active():
            batch.free(row)
        if batch.held is not None:
            texts.end(batch.held, None)
        with self._wake:
            while self._waiting:
                texts.end(self._waiting.popleft(), None)
        texts.close()

    def step(self, mark: int = 0) -> int:
        """One engine step (`Rows.step`), once the text thread has handled the first `mark` items and the
        rows whose requests ended or left are freed -> the mark of the next step (the items handed over
        before this one)."""
        batch, texts = self.batch, self._texts
        # The text of the steps before the previous one is out (the previous one's is made beside
        # this step's graph calls): a request that a stop string ended is freed here at the latest
        # two steps after the one whose token ended it, having decoded at most one token too many.
        texts.wait(mark)
        mark = texts.queued
        for row in batch.active():
            request = batch.slots[row]
            if request.done or request.sink.cancelled.is_set():
                batch.free(row)
        if batch.held is not None and batch.held.sink.cancelled.is_set():  # its client left while it waited
            texts.end(batch.held, None)
            batch.held = None
        try:
            batch.step(self._take)
        except Exception:  # the requests its failed graph call ran ended with the error
            log.exception("a graph call failed")
        return mark

    def _take(self) -> _Request | None:
        """The oldest waiting request whose client has not left, for a free row."""
        with self._wake:
            while self._waiting and self._waiting[0].sink.cancelled.is_set():  # its client left while it waited
                self._texts.end(self._waiting.popleft(), None)
            return self._waiting.popleft() if self._waiting else None

    def _counted(self, graph: str, rows: int) -> None:
        """A graph call into /metrics, before its tokens reach a client."""
        if self.metrics is None:
            return
        m = self.metrics
        if graph == "copy":
            m.copy_calls.inc()
            return
        calls, held = (m.prefill_calls, m.prefill_rows) if graph == "prefill" else (m.decode_calls, m.decode_rows)
        calls.inc()
        held.inc(rows)

    def _looked_up(self, queries: int, hits: int) -> None:
        """A prefix-cache lookup into /metrics: the prompt's tokens, and those taken from a row."""
        if self.metrics is not None:
            self.metrics.prefix_cache_queries.inc(queries)
            self.metrics.prefix_cache_hits.inc(hits)

    def _verified(self, drafted: list[int], accepted: list[int]) -> None:
        """A verify step (speculative decoding) into /metrics: each row's drafts and those it accepted."""
        if self.metrics is not None:
            self.metrics.spec_decoded(drafted, accepted)


def _asked_field(processing: Processing) -> str:
    """The request field behind the first thing `processing` asks for (for an error's `param`)."""
    names = ("logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
    return next((n for n in names if getattr(processing, n) != getattr(NOTHING, n)), "logit_bias")

"""What a request may ask of the engine's runtime, checked before it runs: `Engine` holds the runtime's
limits (its context, its candidate width, its logits-processing variants), compiles the request's
grammar and makes its `decoding.Output`. The engine itself is `batching.BatchEngine`: one step loop
(`static.rows.Rows.step`) over the rows of a runtime with Rows' protocol, whichever runs the model: the
static graphs on CPU (`static/runtime.py`), the compiled artifact on Inferentia2 (`neuron.py`) or
transformers' model (`hf_runtime.py`).
"""

from __future__ import annotations

from ..static.sampling import BIAS_WIDTH, NOTHING, Processing
from .decoding import Output, RequestError, SamplingParams, allowed_mask, bad_word_ids, ends
from .grammar import GrammarError, Grammars


class Engine:
    """What a request may ask of a runtime (its limits, its sampling), checked before it runs, and its
    Output: the engine's side of admission (`batching.BatchEngine` runs the requests)."""

    def __init__(self, runtime, tokenizer, max_context: int, eos_ids: set[int]):
        self.runtime, self.tokenizer = runtime, tokenizer
        self.max_context = max_context  # prompt + generated tokens
        self.eos_ids = frozenset(eos_ids)
        # the most top_k the runtime samples from exactly (its graphs' candidate width; None: any)
        self.max_top_k: int | None = getattr(runtime, "candidates", None)
        # structured output's grammars, their bitmasks as wide as the runtime's logits (`vocab`; else the
        # tokenizer's vocabulary)
        self.grammars = Grammars(tokenizer, getattr(runtime, "vocab", None), self.eos_ids)

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

    def close(self) -> None:
        """Stop what the engine runs (`batching.BatchEngine`: its step loop)."""

    def __enter__(self):
        return self

    def __exit__(self, *_) -> None:
        self.close()

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


def _asked_field(processing: Processing) -> str:
    """The request field behind the first thing `processing` asks for (for an error's `param`)."""
    names = ("logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
    return next((n for n in names if getattr(processing, n) != getattr(NOTHING, n)), "logit_bias")

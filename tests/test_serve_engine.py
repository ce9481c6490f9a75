"""The serving engine without HTTP: sampling, stop sequences, streamed text, limits and chat
prompts, over scripted runtimes and transformers' model (the static graphs: test_serve_batching.py;
the Neuron backend: test_serve_neuron.py)."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from neuron_moe.greedy import greedy, left_pad
from neuron_moe.serve.chat import FALLBACK_STOP, render_chat
from neuron_moe.serve.engine import Engine
from neuron_moe.serve.decoding import GenerationError, Output, RequestError, SamplingParams, Step, held_back
from neuron_moe.serve.hf_runtime import HFRuntime, HostRuntime
from neuron_moe.static.sampling import GREEDY
from neuron_moe.tokenizer import ByteTokenizer, HFTokenizer

from serving import Scripted

BYTES = ByteTokenizer()
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Recording(HFRuntime):
    """transformers' model, recording every token fed back to it after the prompt."""

    def __init__(self, model):
        super().__init__(model)
        self.fed = []

    def logits(self, row, ids, start, keep):
        if start > 0:
            self.fed += ids
        return super().logits(row, ids, start, keep)


def scripted_engine(text: str) -> Engine:
    return Engine(Scripted([b + BYTES.offset for b in text.encode()]), BYTES, {BYTES.eos_token_id})


def run(engine, max_tokens=64, prompt=(2, 50), **kw):
    with engine:
        return list(engine.generate(list(prompt), SamplingParams(max_tokens, temperature=0.0, **kw)))


# ---- text handed out step by step ---------------------------------------------------------------


def test_stop_sequence_cuts_the_text_and_is_never_sent():
    steps = run(scripted_engine("The answer is 42. Done"), stop=("42.",))
    assert "".join(s.text for s in steps) == "The answer is "
    assert steps[-1].finish_reason == "stop" and steps[-1].completion_tokens == len("The answer is 42.")
    assert all("4" not in s.text for s in steps)  # the stop's first character was held back, never sent


def test_a_partial_stop_is_held_back_then_released():
    steps = run(scripted_engine("abcabd"), max_tokens=6, stop=("abx",))
    assert [s.text for s in steps] == ["", "", "abc", "", "", "abd"]
    assert steps[-1].finish_reason == "length"


def test_eos_ends_with_stop_and_flushes_what_was_held():
    steps = run(scripted_engine("hi a"), stop=("ab",))  # "a" is held (could become "ab"), then EOS
    assert "".join(s.text for s in steps) == "hi a"
    assert (steps[-1].finish_reason, steps[-1].completion_tokens) == ("stop", 5)  # the EOS counts


def test_multibyte_characters_are_never_sent_half():
    text = "café ☕ ok"
    steps = run(scripted_engine(text))
    assert all("\ufffd" not in s.text for s in steps)
    assert "".join(s.text for s in steps) == text
    assert len(steps) == len(text.encode()) + 1  # one step per byte token, then EOS


def test_max_tokens_ends_with_length():
    steps = run(scripted_engine("hello world"), max_tokens=4)
    assert ("".join(s.text for s in steps), steps[-1].finish_reason) == ("hell", "length")


def test_held_back():
    assert held_back("xx\ufffd", ()) == 1
    assert held_back("hello wo", ("world", "xyz")) == 2
    assert held_back("hello", ("world",)) == 0
    assert held_back("xa\ufffd", ("a\u00e9",)) == 2  # the stop may go on in the incomplete character


class ChunkTokenizer:
    """Token i is chunks[i], any slice of UTF-8 bytes: decoded as a byte-level BPE decodes (a partial
    character shows as U+FFFD)."""

    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks

    def decode(self, ids) -> str:
        return b"".join(self.chunks[i] for i in ids).decode("utf-8", errors="replace")


def expected_output(tokenizer, n: int, stops) -> tuple[str, str]:
    """The answer from scratch: after each token, the text decoded so far; the first that holds a stop
    string ends there, at the earliest stop in it (nothing of the stop, nothing after it)."""
    for i in range(1, n + 1):
        text = tokenizer.decode(range(i)).rstrip("\ufffd")
        cuts = [j for j in (text.find(s) for s in stops) if j >= 0]
        if cuts:
            return text[: min(cuts)], "stop"
    return tokenizer.decode(range(n)), "length"


ALPHABET = st.sampled_from(["a", "b", " ", "\u00e9", "\u20ac", "\U0001f600"])  # 1, 2, 3 and 4 UTF-8 bytes


@st.composite
def split_texts(draw):
    """(chunks, stops): a text cut into tokens at random byte offsets (inside characters too), and stop
    strings — some of them pieces of the text, so that they occur."""
    text = draw(st.text(ALPHABET, min_size=1, max_size=14))
    data = text.encode()
    cuts = sorted(draw(st.sets(st.integers(1, len(data) - 1), max_size=len(data) - 1))) if len(data) > 1 else []
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    pieces = st.integers(0, len(text) - 1).flatmap(
        lambda a: st.integers(a + 1, min(len(text), a + 4)).map(lambda b: text[a:b])
    )
    stops = draw(st.lists(pieces | st.text(ALPHABET, min_size=1, max_size=3), min_size=1, max_size=4))
    return chunks, tuple(stops)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(case=split_texts())
@example(case=([b"xa", b"\xc3", b"\xa9!"], ("a\u00e9",)))  # "xa" + half of "é": the "a" was sent, then the stop
@example(case=([b"a\xdf", b"\x85b"], ("\ufffd",)))  # a stop of U+FFFD never matches half of "\u07c5"
def test_no_part_of_a_stop_string_reaches_the_client_whatever_the_split(case):
    """Streamed, each step's text is final (never a partial character, never taken back); collected
    (a request without `stream`: the steps' texts joined), the answer ends just before the stop."""
    chunks, stops = case
    tokenizer = ChunkTokenizer(chunks)
    output = Output(tokenizer, frozenset(), SamplingParams(len(chunks), temperature=0.0, stop=stops))
    streamed, finish = [], None
    for token in range(len(chunks)):
        step = output.next(token)
        assert "\ufffd" not in step.text, (step, chunks)
        streamed.append(step.text)
        finish = step.finish_reason
        if finish:
            break
    want, want_finish = expected_output(tokenizer, len(chunks), stops)
    assert ("".join(streamed), finish) == (want, want_finish), (chunks, stops, streamed)


def test_a_stop_of_the_replacement_character_sees_only_complete_characters():
    """Half of a two-byte character decodes as U+FFFD; a stop string of U+FFFD must not cut the
    text there (it dropped the character), while a whole U+FFFD in the text is a match."""
    chunks = [b"a\xdf", b"\x85", b"b\xef\xbf\xbd", b"c"]  # "a", "\u07c5" in two halves, "b", a real U+FFFD, "c"
    output = Output(ChunkTokenizer(chunks), frozenset(), SamplingParams(8, temperature=0.0, stop=("\ufffd",)))
    steps = [output.next(token) for token in range(4)]
    assert [s.text for s in steps[:3]] == ["a", "\u07c5", "b"]
    assert (steps[3].text, steps[3].finish_reason) == ("", "stop")


def whole_text_steps(tokenizer, tokens, params: SamplingParams, eos_ids=frozenset()) -> list[Step]:
    """The reference Steps: the whole output decoded after each token, stop strings looked for in all
    of its complete characters (the first to end a stop is its stop_reason), and what may grow into a
    stop or is a partial character held back."""
    steps, kept, sent = [], [], 0
    for count, token in enumerate(tokens, 1):
        if token in eos_ids:
            return [*steps, Step((tokenizer.decode(kept) if kept else "")[sent:], "stop", count)]
        kept.append(token)
        text = tokenizer.decode(kept)
        complete = text.rstrip("\ufffd")
        found = [(j, s) for s in params.stop if (j := complete.find(s)) >= 0]
        if found:
            cut, stop = min(found)
            return [*steps, Step(text[sent:cut], "stop", count, stop_reason=stop)]
        if count == params.max_tokens:
            return [*steps, Step(text[sent:], "length", count)]
        safe = len(text) - held_back(text, params.stop)
        steps.append(Step(text[sent:safe], None, count))
        sent = max(sent, safe)
    return steps


def lagged_steps(output: Output, tokens) -> list[Step]:
    """The Steps as the batching engine makes them: the text side (`text`) a token behind the id
    side (`take`), up to the first Step with a finish reason."""
    steps, behind = [], None  # the (count, finish) of the token the text side has yet to take
    for token in tokens:
        finish = output.take(token)
        if behind is not None:
            steps.append(output.text(*behind))
            if steps[-1].finish_reason:
                return steps
        behind = (output.count, finish)
        if finish:
            break
    return [*steps, output.text(*behind)]


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_port):
    return HFTokenizer(tiny_port.checkpoint)


MIXED = "Café 4,50 € 🍮 naïve — ### the tides 🌊 and\n\nthe end"


@st.composite
def token_runs(draw, vocab: int, text_ids: list[int]):
    """Token ids: runs of a text's own tokens (whole characters, mostly) and ids drawn at random
    (special tokens, characters cut in pieces, invalid UTF-8)."""
    tokens = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            start = draw(st.integers(0, len(text_ids) - 1))
            tokens += text_ids[start : start + draw(st.integers(1, 12))]
        else:
            tokens += draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8))
    return tokens


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_the_text_is_that_of_the_whole_output_decoded_after_each_token(tiny_tokenizer, data):
    """Incremental detokenizing and the stop search in the text's tail give the Steps that decoding
    the whole output after each token gives: texts, finish reasons, counts, whether the text side
    runs with the id side (`next`) or a token behind it (the batching engine), for the tiny port's
    byte-level BPE (special tokens skipped, characters cut across tokens) and any split of UTF-8."""
    if data.draw(st.booleans(), "tokenizer"):
        tokenizer = tiny_tokenizer
        tokens = data.draw(token_runs(2048, tiny_tokenizer.encode(MIXED, add_special_tokens=False)), "tokens")
    else:
        chunks, _ = data.draw(split_texts(), "chunks")
        chunks += [b"\xff", b"\xe2\x82"]  # an invalid byte, and two of a three-byte character
        tokenizer = ChunkTokenizer(chunks)
        tokens = data.draw(st.lists(st.integers(0, len(chunks) - 1), min_size=1, max_size=20), "tokens")
    text = tokenizer.decode(tokens)
    pieces = st.integers(0, max(0, len(text) - 1)).flatmap(lambda a: st.integers(1, 4).map(lambda n: text[a : a + n]))
    stops = tuple(
        s for s in data.draw(st.lists(pieces | st.sampled_from(["###", "\n\n", "\ufffd", "zz"]), max_size=3)) if s
    )
    params = SamplingParams(data.draw(st.integers(1, len(tokens) + 1), "max_tokens"), temperature=0.0, stop=stops)
    eos = frozenset(data.draw(st.sets(st.sampled_from(tokens), max_size=1), "eos"))
    want = whole_text_steps(tokenizer, tokens, params, eos)
    together = []
    output = Output(tokenizer, eos, params)
    for token in tokens:
        together.append(output.next(token))
        if together[-1].finish_reason:
            break
    assert together == want, (tokens, stops)
    assert lagged_steps(Output(tokenizer, eos, params), tokens) == want, (tokens, stops)


def test_a_sampled_request_draws_its_uniforms_in_the_generators_order():
    """Drawn a block at a time, the sampling rows are those of one draw per token (the seed decides)."""
    for max_tokens in (3, 150):
        params = SamplingParams(max_tokens, temperature=0.7, top_k=40, top_p=0.9, seed=11)
        output, generator = Output(BYTES, frozenset(), params), torch.Generator().manual_seed(11)
        rows = [output.sampling() for _ in range(max_tokens)]
        assert rows == [(0.7, 40.0, 0.9, float(torch.rand((), generator=generator))) for _ in range(max_tokens)]
    assert Output(BYTES, frozenset(), SamplingParams(4, temperature=0.0, seed=11)).sampling() == GREEDY


def test_cancelled_generation_stops_without_a_final_step():
    import threading

    cancelled = threading.Event()
    steps = []
    with scripted_engine("abcdefgh") as engine:
        for step in engine.generate([2], SamplingParams(8, temperature=0.0), cancelled):
            steps.append(step)
            if len(steps) == 3:
                cancelled.set()
    assert len(steps) == 3 and steps[-1].finish_reason is None


def test_non_finite_logits_fail_the_request_not_answer_it(tiny_port):
    """NaN logits: greedy would take the argmax of NaNs as a token (empty text) and sampling would raise
    in multinomial (a 500); both are the same clear failure."""
    nan_from = Scripted([b + BYTES.offset for b in b"abc"])
    inner = nan_from.script
    nan_from.script = lambda i: inner(i) if i < 2 else torch.full((BYTES.vocab_size,), float("nan"))
    with Engine(nan_from, BYTES, {BYTES.eos_token_id}) as engine:
        for temperature in (0.0, 1.0):
            steps = []
            with pytest.raises(GenerationError, match="non-finite logits .* at step 2"):
                for step in engine.generate([2], SamplingParams(8, temperature=temperature, seed=0)):
                    steps.append(step)
            assert "".join(s.text for s in steps) == "ab"


# ---- sampling ------------------------------------------------------------------------------------


class Fixed(HostRuntime):
    """The same logits after every token."""

    def __init__(self, logits):
        super().__init__(1, logits.shape[-1], 511)
        self.fixed = logits

    def reset(self, row):
        pass

    def logits(self, row, ids, start, keep):
        return self.fixed[None]


def sample(logits, row) -> int:
    """The token the host runtime's decode picks from `logits` with the sampling row `row`."""
    tokens, _ = Fixed(logits).decode(torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([row]))
    return int(tokens[0])


def test_a_vanishing_temperature_or_top_p_samples_the_top_token():
    """Found by tests/test_fuzz.py: a schema-valid temperature of 1e-300 overflowed logits / T to inf
    and softmax to NaN; a top_p of 5e-324 is 0 in float32 and kept no token (multinomial failed)."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    for temperature, top_p in ((1e-300, 1.0), (5e-324, 1.0), (1e-6, 1.0), (1.0, 5e-324), (1.0, 1e-9), (1.0, 0.0)):
        for u in (0.0, 0.5, 0.999):
            assert sample(logits, (temperature, 0, top_p, u)) == 0


def test_the_host_samples_with_every_token_a_candidate():
    """A runtime on the host (transformers' model) samples with the graphs' own function, nothing capped:
    a top-k past the graphs' candidate width keeps what it asks for (tests/test_sampling.py: the graphs)."""
    logits = torch.linspace(0.0, -1.0, 1000)  # token i is the i-th most likely
    u = (torch.arange(2000) + 0.5) / 2000
    drawn = {sample(logits, (1.0, 600, 1.0, float(x))) for x in u}
    assert max(drawn) > 256 and max(drawn) < 600


@pytest.fixture(scope="module")
def tiny_engine(tiny_eager):
    with Engine(HFRuntime(tiny_eager), BYTES, {BYTES.eos_token_id}) as engine:
        yield engine


def test_greedy_generation_is_the_reference_greedy(tiny_engine, tiny_eager):
    prompt = BYTES.encode("Mixture-of-Experts models route each token to")
    recording = Recording(tiny_eager)
    steps = run(Engine(recording, BYTES, set(tiny_engine.eos_ids)), max_tokens=16, prompt=prompt)
    reference = greedy(tiny_eager, *left_pad([prompt], 0), 16).tokens[0].tolist()
    assert steps[-1].completion_tokens == 16 and recording.fed == reference[:15]
    assert "".join(s.text for s in steps) == BYTES.decode(reference)


def test_seeded_sampling_is_reproducible(tiny_engine):
    prompt = BYTES.encode("Once upon a time")

    def text(**kw):
        return "".join(s.text for s in tiny_engine.generate(prompt, SamplingParams(8, **kw)))

    assert text(temperature=1.0, seed=5) == text(temperature=1.0, seed=5)
    assert text(temperature=1.0, seed=5) != text(temperature=1.0, seed=6)
    assert text(temperature=1.0, top_p=1e-9, seed=7) == text(temperature=0.0)  # a nucleus of one is greedy


def test_token_budget(tiny_engine):
    assert tiny_engine.max_tokens_for(500, None) == 12  # the rest of the 512-token context
    with pytest.raises(RequestError, match="exceeds it by 8") as e:
        tiny_engine.max_tokens_for(500, 20)
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError, match="leaves no room") as e:
        tiny_engine.max_tokens_for(512, None)
    assert e.value.param == "prompt"
    with pytest.raises(RequestError, match="the prompt has no tokens") as e:
        tiny_engine.max_tokens_for(0, None)
    assert e.value.param == "prompt"


# ---- chat prompts --------------------------------------------------------------------------------


def test_fallback_chat_template_without_one_in_the_tokenizer():
    ids, stops = render_chat(BYTES, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert BYTES.decode(ids) == "System: Be brief.\n\nUser: Hi\n\nAssistant:"
    assert ids[0] == BYTES.bos_token_id and stops == (FALLBACK_STOP,)


def test_the_tokenizers_chat_template_is_used_when_it_has_one(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "<turn>", "<end>", "system", "user", "assistant", "Hi", "Be", "brief"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<turn> {{ m['role'] }} {{ m['content'] }} <end> "
        "{% endfor %}{% if add_generation_prompt %}<turn> assistant {% endif %}"
    )
    tok.save_pretrained(tmp_path)

    ids, stops = render_chat(
        HFTokenizer(tmp_path), [{"role": "developer", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    )
    assert [words[i] for i in ids] == [
        "<bos>",
        "<turn>",
        "system",
        "Be",
        "brief",
        "<end>",
        "<turn>",
        "user",
        "Hi",
        "<end>",
        "<turn>",
        "assistant",
    ]  # one BOS
    assert stops == ()

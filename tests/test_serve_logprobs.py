"""logprobs, top_logprobs, echo's prompt logprobs, penalties, logit_bias and min_p through the
official `openai` client against `serve --backend static` (the logits-processing graphs): OpenAI's
response shapes for chat and completions, streamed and not, the numbers log_softmax of HF eager's
fp32 logits; what the graphs cannot take is refused by name."""

import httpx
import openai
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from neuron_moe import cli
from neuron_moe.greedy import greedy
from neuron_moe.port import load_port
from neuron_moe.serve import server
from neuron_moe.serve.chat import render_chat
from neuron_moe.static.sampling import BIAS_WIDTH
from neuron_moe.tokenizer import HFTokenizer, load_tokenizer

from serving import serving, wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
ATOL = 1e-4  # fp32 logprobs of the graphs against HF eager's (test_logits_processing.py: LOGPROB_ATOL)


@pytest.fixture(scope="module")
def url():
    app = server.make_app(cli.serve_config(["serve", "--backend", "static", "--no-compile"]))  # uncompiled: fast
    with serving(app) as base:
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, 60, "the model to be ready")
        yield base


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(load_port("tiny-gemma4-moe"))


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def eager_logprobs(model, ids: list[int], n: int):
    """HF eager's greedy continuation of `ids` by n tokens, and log_softmax of its logits at every
    position of prompt + continuation ([len + n - 1, V])."""
    tokens = greedy(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), n).tokens[0].tolist()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + tokens[:-1]])).logits[0].float()
    return tokens, logits.log_softmax(-1)


def test_chat_logprobs_and_top_logprobs_are_hf_eagers(url, tokenizer, tiny_eager):
    ids, _ = render_chat(tokenizer, MESSAGES)
    tokens, logp = eager_logprobs(tiny_eager, ids, 8)
    got = client(url).chat.completions.create(
        model="tiny-gemma4-moe", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5
    )
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == len(tokens)
    for i, (entry, token) in enumerate(zip(content, tokens)):
        row = logp[len(ids) - 1 + i]
        assert entry.token == tokenizer.decode([token]) and bytes(entry.bytes) == entry.token.encode()
        assert abs(entry.logprob - float(row[token])) < ATOL
        top, top_ids = row.topk(5)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in top_ids.tolist()]
        torch.testing.assert_close(torch.tensor([t.logprob for t in entry.top_logprobs]), top, atol=ATOL, rtol=0)
    streamed = client(url).chat.completions.create(
        model="tiny-gemma4-moe",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        stream=True,
    )
    chunks = [e for chunk in streamed for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in chunks] == [(e.token, e.logprob) for e in content]


def test_completions_echo_with_logprobs_as_lm_eval_asks(url, tokenizer, tiny_eager):
    """lm-eval-harness's loglikelihood request (echo, logprobs=1, max_tokens=1): every prompt
    token's logprob (the first: null) and the one generated token's, eager's."""
    ids = tokenizer.encode(PROMPT)
    tokens, logp = eager_logprobs(tiny_eager, ids, 1)
    got = client(url).completions.create(
        model="tiny-gemma4-moe", prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    choice = got.choices[0]
    assert choice.text == PROMPT + tokenizer.decode(tokens)
    lp = choice.logprobs
    everything = ids + tokens
    assert lp.tokens == [tokenizer.decode([t]) for t in everything]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [float(logp[i, t]) for i, t in enumerate(everything[1:])]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), torch.tensor(want), atol=ATOL, rtol=0)
    for i, top in enumerate(lp.top_logprobs[1:]):
        best = int(logp[i].argmax())
        assert abs(top[tokenizer.decode([best])] - float(logp[i, best])) < ATOL
        assert lp.tokens[i + 1] in top  # the chosen token among its top ones, as vLLM's
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(PROMPT)
    streamed = client(url).completions.create(
        model="tiny-gemma4-moe", prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1, stream=True
    )
    parts = [c for chunk in streamed for c in chunk.choices if c.logprobs]
    assert "".join(c.text for c in parts) == choice.text
    assert [t for c in parts for t in c.logprobs.token_logprobs] == lp.token_logprobs


def test_logit_bias_penalties_and_min_p_are_honoured(url, tokenizer):
    """A +100 bias makes every greedy token that one; penalties and min_p change the greedy text
    of a prompt that repeats itself, and a request with them all is served."""
    forced = tokenizer.encode(" Paris", add_special_tokens=False)[-1]
    got = client(url).completions.create(
        model="tiny-gemma4-moe", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(forced): 100}
    )
    assert got.choices[0].text == tokenizer.decode([forced]) * 6
    plain = client(url).completions.create(model="tiny-gemma4-moe", prompt=PROMPT, max_tokens=24, temperature=0)
    penalised = client(url).completions.create(
        model="tiny-gemma4-moe",
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        presence_penalty=2.0,
        frequency_penalty=2.0,
        extra_body={"repetition_penalty": 2.0, "min_p": 0.2},
    )
    assert penalised.choices[0].text != plain.choices[0].text
    sampled = client(url).completions.create(
        model="tiny-gemma4-moe", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, extra_body={"min_p": 0.3}
    )
    assert sampled.usage.completion_tokens == 8


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"top_logprobs": 3}, "top_logprobs", "top_logprobs needs logprobs: true"),
        ({"logit_bias": {str(i): 1 for i in range(BIAS_WIDTH + 1)}}, "logit_bias", f"at most {BIAS_WIDTH} entries"),
        ({"logit_bias": {"999999": 5}}, "logit_bias", "not below the vocabulary size"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than or equal to 0.01"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
    ],
)
def test_what_the_graphs_cannot_take_is_refused_by_name(url, body, param, message):
    raw = httpx.post(
        f"{url}/v1/chat/completions", json={"model": "tiny-gemma4-moe", "messages": MESSAGES, "max_tokens": 2, **body}
    )
    assert raw.status_code == 400, raw.text
    error = raw.json()["error"]
    assert error["param"] == param and message in error["message"], error


def _byte_fallback_tokenizer(directory) -> HFTokenizer:
    """A SentencePiece-style tokenizer as Gemma's is built (BPE with byte fallback, "▁" for a space): a
    character missing from its vocabulary is written as its UTF-8 bytes, one `<0xNN>` token each."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    pieces = [f"<0x{b:02X}>" for b in range(256)] + ["\u2581", "w", "r", "l", "d", "\u2581w", "H", "e", "o"]
    vocab = {p: i for i, p in enumerate(specials + pieces)}
    tok = Tokenizer(models.BPE(vocab, [("\u2581", "w")], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    names = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    PreTrainedTokenizerFast(tokenizer_object=tok, **names).save_pretrained(directory)
    return HFTokenizer(directory)


def test_a_tokens_bytes_are_its_own_in_byte_level_and_byte_fallback_vocabularies(tokenizer, tmp_path):
    """`token_bytes`, what logprobs' `bytes` and `text_offset` are made of: for the tiny port's byte-level
    BPE and a byte-fallback vocabulary (Gemma's kind), each token of a text with 2- and 4-byte
    characters has its own bytes (a token inside a character: its byte, not U+FFFD's), and they join
    into the text; a special token adds none, as decoding skips it."""
    text = "Hello \U0001f642 w\u00f6rld"
    for tok in (tokenizer, _byte_fallback_tokenizer(tmp_path)):
        ids = tok.encode(text)
        parts = [tok.token_bytes(i) for i in ids]
        assert b"".join(parts) == text.encode() and tok.token_bytes(tok.bos_token_id) == b""
        partial = [p for i, p in zip(ids, parts) if tok.decode([i]) == "\ufffd"]
        assert len(partial) == 6 and all(len(p) == 1 and p[0] >= 0x80 for p in partial), parts
    every = range(2048)  # the tiny vocabulary: a whole token's bytes are its text's
    assert all(tokenizer.token_bytes(i).decode("utf-8", "replace") == tokenizer.decode([i]) for i in every)

"""Tokenizers a port can name: `bytes` (built in, for seeded random ports) or `checkpoint`
(the HF tokenizer saved beside the weights)."""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from transformers import AutoTokenizer

from .config import read_config_file
from .errors import UserError

# The files of an HF tokenizer directory that serving reads (an artifact carries them): the tokenizer
# itself (one of TOKENIZER_MODELS), its settings and special tokens, and the chat template when it
# is a file of its own.
TOKENIZER_MODELS = ("tokenizer.json", "tokenizer.model")
TOKENIZER_FILES = (
    *TOKENIZER_MODELS,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def _byte_level_alphabet() -> dict[str, int]:
    """A byte-level BPE's vocabulary writes byte b as one character (GPT-2's table): the printable
    Latin-1 bytes as themselves, the others as 256, 257, ... in order -> {character: byte}."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(moved)}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids: pad 0, eos 1, bos 2, byte b -> b + 3."""

    pad_token_id, eos_token_id, bos_token_id = 0, 1, 2
    offset = 3
    vocab_size = 256 + offset
    max_token_bytes = 1  # of the text a token stands for
    chat_template = None  # the server falls back to a plain-text template (serve/chat.py)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.bos_token_id] * add_special_tokens + [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The bytes `token` adds to the decoded text (a special token: none)."""
        return bytes([token - self.offset]) if self.offset <= token < self.vocab_size else b""


class HFTokenizer:
    def __init__(self, path: Path):
        if not Path(path).is_dir():  # else transformers takes the path for a hub repo id
            raise UserError(f"tokenizer directory {path} not found")
        if (Path(path) / "config.json").is_file():
            # AutoTokenizer parses it with transformers' own config class, which builds a view of every
            # layer (a config.json claiming 10^8 layers would hang it): our checks first
            read_config_file(Path(path) / "config.json")
        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError, StrictDataclassError) as e:  # the last: its config.json's
            raise UserError(f"{path}: no usable tokenizer: {e}") from None
        self.pad_token_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else 0
        self.eos_token_id = self._tok.eos_token_id
        self.bos_token_id = self._tok.bos_token_id
        # At most this many bytes of input text per token (the server refuses a prompt longer than its
        # context could hold without tokenizing it): the longest token's text, +1 for a space a decoder
        # strips, x4 for a normalizer that maps a 4-byte character to a 1-byte one.
        backend = self._tok.backend_tokenizer
        texts = backend.decode_batch([[i] for i in range(backend.get_vocab_size())], skip_special_tokens=False)
        self.max_token_bytes = 4 * (max(len(t.encode("utf-8")) for t in texts) + 1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 bytes `token` adds to the decoded text: its text's, or, for a token that holds part
        of a character (alone it decodes to U+FFFD), the bytes its vocabulary entry stands for: a
        byte-fallback piece `<0xNN>` (SentencePiece's) or the characters of a byte-level BPE (GPT-2's
        alphabet, one character a byte)."""
        text = self.decode([token])
        if "\ufffd" not in text:
            return text.encode()
        piece = self._tok.convert_ids_to_tokens(token)
        if byte := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(byte[1], 16)])
        if all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return text.encode()

    @property
    def chat_template(self) -> str | None:
        return self._tok.chat_template

    @property
    def backend(self):
        """The `tokenizers` tokenizer underneath: its JSON is the token table a grammar compiles against."""
        return self._tok.backend_tokenizer

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt ids for a conversation, the assistant's turn opened. The rendered text
        already holds the template's special tokens, so encoding adds none."""
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self._tok.encode(text, add_special_tokens=False)


def load_tokenizer(port, checkpoint: Path | None = None):
    if port.tokenizer == "bytes":
        tok = ByteTokenizer()
        if port.config.vocab_size < tok.vocab_size:
            raise UserError(f"port {port.name!r}: vocab_size {port.config.vocab_size} < {tok.vocab_size} byte tokens")
        return tok
    path = checkpoint or port.checkpoint
    if path is None:
        raise UserError(f"port {port.name!r} takes its tokenizer from the checkpoint: pass --checkpoint DIR")
    return HFTokenizer(Path(path))


def answer_text(tokenizer, tokens: list[int]) -> str:
    """The generated text up to the first EOS (the model's whole answer)."""
    if tokenizer.eos_token_id in tokens:
        tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
    return tokenizer.decode(tokens)

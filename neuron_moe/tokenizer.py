"""Tokenizers a port can name: `bytes` (built in, for seeded random ports) or `checkpoint`
(the HF tokenizer saved beside the weights)."""

from __future__ import annotations

from pathlib import Path

from .errors import UserError


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids: pad 0, eos 1, bos 2, byte b -> b + 3."""

    pad_token_id, eos_token_id, bos_token_id = 0, 1, 2
    offset = 3
    vocab_size = 256 + offset
    chat_template = None  # the server falls back to a plain-text template (serve/chat.py)

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path):
        from transformers import AutoTokenizer

        if not Path(path).is_dir():  # else transformers takes the path for a hub repo id
            raise UserError(f"tokenizer directory {path} not found")
        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: no usable tokenizer: {e}") from None
        self.pad_token_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else 0
        self.eos_token_id = self._tok.eos_token_id
        self.bos_token_id = self._tok.bos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._tok.chat_template

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

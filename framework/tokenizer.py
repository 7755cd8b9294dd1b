"""Text -> token ids, behind one small interface that data, export and generation share.

Why one interface: the data pipeline encodes documents, the HF export writes the tokenizer next to
the weights, and ``framework.generate`` decodes samples; each takes a ``Tokenizer`` and never asks
which kind it is. ``load_tokenizer`` builds one from the typed ``TokenizerConfig``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

from framework.config import TokenizerConfig, TokenizerKind


class Tokenizer(Protocol):
    """What every tokenizer offers. ``bos_id``/``eos_id`` are None when the vocabulary has none."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def digest(self) -> str:
        """sha256 of what defines the vocabulary: token files record it, training compares it."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255); no special tokens, so the embedded default is unchanged."""

    vocab_size = 256
    bos_id: int | None = None
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def digest(self) -> str:
        return hashlib.sha256(b"framework.bytes/v1").hexdigest()


def load_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """Build the configured tokenizer. Raises ValueError naming the kind when it is not available."""
    if cfg.kind is TokenizerKind.bytes:
        return ByteTokenizer()
    raise ValueError(f"tokenizer.kind={cfg.kind.value} is not available yet; valid: bytes")

"""``data=sft``: chat / instruction records for fine-tuning, the loss masked on prompt tokens.

A jsonl line is a conversation, ``{"messages": [{"role": ..., "content": ...}, ...]}`` (roles
``system``, ``user``, ``assistant``), or a prompt/response pair ``{"prompt": ..., "response": ...}``
(read as one user and one assistant message); the keys are ``data.messages_field``,
``data.prompt_field`` and ``data.response_field``.

How an example becomes tokens:
- with a chat template (an HF tokenizer folder's ``chat_template.jinja``, where transformers 5's
  ``save_pretrained`` writes it, or its ``tokenizer_config.json``'s ``chat_template``:
  framework.data.tokenizer.read_chat_template): the template is rendered with jinja2 as ``transformers``' ``apply_chat_template``
  renders it (framework.data.chat_template: a sandboxed environment, ``trim_blocks``/``lstrip_blocks``,
  ``raise_exception``, ``bos_token``/``eos_token``), one message at a time: the text an assistant message adds after the
  generation prompt (its content and the template's end-of-turn token) is trained on, everything else
  (system, user, the assistant header) is masked. A template that does not render a conversation as
  a prefix of its continuation is refused, naming the message.
- without one (the plain format): BOS (with ``tokenizer.add_bos=true``), then each non-assistant
  message's ``content + "\\n"`` (masked) and each assistant message's ``content`` followed by EOS
  (trained on).

Whole examples are packed back to back into rows of ``seq_len + 1`` tokens (``data.sft_pack``;
false: one example per row), padded with EOS whose targets are masked. Each example's first token
carries ``DOC_START`` (framework.models): the model starts a document there, so attention and RoPE
positions stay within the example (``data.document_mask=true`` is refused: an EOS mask would also
cut a conversation at an EOS inside it). An example longer than the row is cut
(the end of its response is lost; the number cut is logged before launch); an example whose prompt
alone fills the row (nothing left to learn) is refused.

Rows carry their mask in the sign: token ``t`` whose target is masked is stored as ``~t`` (< 0), so
the packer, mixtures, prefetch and the replicated data state handle SFT rows as any other rows;
``split_rows`` turns them into (inputs, targets) with ``IGNORE_INDEX`` where the mask is set.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from framework.config.schema import DataConfig
from framework.data.chat_template import TemplateBudget, chat_env, render_bounded
from framework.data.records import json_line, watched
from framework.data.tokenizer import Tokenizer, eos_fix
from framework.data.tokens import FileStamp
from framework.models.parts.masks import DOC_START

log = logging.getLogger("framework")

# F.cross_entropy's default ignore_index, which the model's head_loss uses: these targets add nothing.
IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Fields:
    """The jsonl keys of an SFT record (data.messages_field / prompt_field / response_field)."""

    messages: str = "messages"
    prompt: str = "prompt"
    response: str = "response"

    @classmethod
    def of(cls, data: DataConfig) -> Fields:
        return cls(data.messages_field, data.prompt_field, data.response_field)


def split_rows(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (batch, seq_len + 1) -> (inputs, targets); a negative entry ``~t`` is token ``t`` whose
    target is masked (IGNORE_INDEX). Rows with no mask give the same views as ``m[:, :-1], m[:, 1:]``."""
    if not bool((m < 0).any()):
        return m[:, :-1], m[:, 1:]
    ids = torch.where(m < 0, torch.bitwise_not(m), m)
    # Inputs keep DOC_START (packed examples: the model reads it); targets never carry it.
    targets = torch.bitwise_and(ids[:, 1:], DOC_START - 1)
    return ids[:, :-1], torch.where(m[:, 1:] < 0, IGNORE_INDEX, targets)


def parse_example(row: Any, fields: Fields, where: str) -> list[dict[str, str]]:
    """One jsonl record -> its messages; ValueError naming the line and what is valid."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: an SFT record must be a JSON object, got {type(row).__name__}")
    if fields.messages in row:
        messages = row[fields.messages]
        if not isinstance(messages, list) or not messages:
            raise ValueError(
                f"{where}: {fields.messages!r} must be a non-empty list of {{role, content}} messages"
            )
    elif fields.prompt in row and fields.response in row:
        messages = [
            {"role": "user", "content": row[fields.prompt]},
            {"role": "assistant", "content": row[fields.response]},
        ]
    else:
        raise ValueError(
            f"{where}: no {fields.messages!r} and no {fields.prompt!r}/{fields.response!r} (it has "
            f"{sorted(row)[:8]}); set data.messages_field, or data.prompt_field and data.response_field"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(
                f"{where}: message {i} must be an object with 'role' and 'content', got {m!r:.80}"
            )
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {i} has role {m['role']!r}; valid roles: {list(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(
                f"{where}: message {i} ({m['role']}) has content of type {type(m['content']).__name__}, "
                "not a string"
            )
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where}: no assistant message: nothing to train on")
    return out


def read_records(files: Sequence[Path], fields: Fields, skip: int = 0) -> Iterator[tuple[str, list[dict]]]:
    """(where, messages) of every non-blank line of ``files`` in order, after the first ``skip``
    (skipped lines are counted, not parsed)."""
    n = 0
    for path in files:
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                n += 1
                if n <= skip:
                    continue
                where = f"{path}:{lineno}"
                yield where, parse_example(json_line(raw, where), fields, where)


class ChatFormat:
    """Messages -> (token ids, which of them are trained on), by the chat template or the plain format."""

    def __init__(self, tok: Tokenizer, add_bos: bool) -> None:
        if tok.eos_id is None:
            raise ValueError(
                f"data=sft needs an EOS token to end each response (and to pad); tokenizer={tok.kind.value} "
                f"has none: {eos_fix(tok)}"
            )
        self.tok = tok
        self.bos = tok.bos_id if add_bos else None
        self.template_text = tok.chat_template
        self.template = None
        if self.template_text is not None:
            try:
                self.template = chat_env().from_string(self.template_text)
            except Exception as e:  # noqa: BLE001 - jinja2 raises TemplateSyntaxError and others
                where = getattr(tok, "path", "the tokenizer")
                first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                raise ValueError(
                    f"data=sft: the chat template of {where} does not parse here ({first}); valid: a "
                    "template transformers' apply_chat_template renders, or a tokenizer folder without one "
                    "(the plain format)"
                ) from None
        self.special = {
            "bos_token": getattr(tok, "bos_token", None) or "",
            "eos_token": getattr(tok, "eos_token", None) or "",
        }

    @property
    def description(self) -> str:
        return "the tokenizer's chat template" if self.template is not None else "the plain format"

    def _render(self, messages: list[dict], generation: bool, where: str) -> str:
        assert self.template is not None
        try:
            return render_bounded(
                self.template, messages=messages, add_generation_prompt=generation, **self.special
            )
        except TemplateBudget as e:
            raise ValueError(
                f"{where}: the chat template is refused: {e}; a chat template may not run unbounded work"
            ) from None
        except Exception as e:  # noqa: BLE001 - a template's raise_exception, or any jinja2 error
            raise ValueError(f"{where}: the chat template failed on this conversation ({e})") from e

    def prompt(self, messages: list[dict], where: str = "--chat") -> str:
        """The text that asks the model for the next assistant turn (``add_generation_prompt``):
        what ``python -m framework generate --chat`` encodes. ValueError without a template."""
        if self.template is None:
            raise ValueError(
                f"{where}: {getattr(self.tok, 'path', 'the tokenizer')} has no chat template (no "
                "chat_template.jinja, none in tokenizer_config.json); drop --chat to use the prompt as it is"
            )
        return self._render(messages, True, where)

    def segments(self, messages: list[dict], where: str) -> list[tuple[str, bool]]:
        """(text, trained on) pieces whose concatenation is the rendered conversation."""
        if self.template is None:
            return [
                (m["content"], True) if m["role"] == "assistant" else (m["content"] + "\n", False)
                for m in messages
            ]
        out: list[tuple[str, bool]] = []
        done = ""
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                head = self._render(messages[:i], True, where)
                out.append((self._after(done, head, i, where), False))
                done = head
            full = self._render(messages[: i + 1], False, where)
            out.append((self._after(done, full, i, where), m["role"] == "assistant"))
            done = full
        return out

    @staticmethod
    def _after(done: str, text: str, i: int, where: str) -> str:
        if not text.startswith(done):
            raise ValueError(
                f"{where}: the chat template renders message {i} by changing the text before it, so "
                "its prompt tokens cannot be masked; use a template that renders a conversation as a "
                "prefix of its continuation (or no template: the plain format)"
            )
        return text[len(done) :]

    def encode_many(self, examples: Sequence[tuple[str, list[dict]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, trained-on flags) per example; every segment encoded in one tokenizer call."""
        segs = [self.segments(msgs, where) for where, msgs in examples]
        flat = [t for s in segs for t, _ in s]
        ids = self.tok.encode_batch(flat) if flat else []
        out, k = [], 0
        for s in segs:
            parts: list[list[int]] = []
            flags: list[np.ndarray] = []
            if self.bos is not None and self.template is None:
                parts.append([self.bos])
                flags.append(np.zeros(1, dtype=bool))
            for _, target in s:
                seg = list(ids[k])
                k += 1
                if target and self.template is None:
                    seg.append(self.tok.eos_id)  # type: ignore[arg-type]  # checked in __init__
                parts.append(seg)
                flags.append(np.full(len(seg), target, dtype=bool))
            out.append((np.asarray([i for p in parts for i in p], dtype=np.int64), np.concatenate(flags)))
        return out


def to_row(
    ids: np.ndarray, trained: np.ndarray, window: int, pad: int, where: str
) -> tuple[np.ndarray, bool]:
    """One example -> a signed row of ``window`` tokens (see the module docstring) and whether it was
    cut. Raises ValueError when no trained token fits (the prompt alone fills the row)."""
    hits = np.flatnonzero(trained[1:]) + 1  # position 0 is an input only, never a target
    if hits.size == 0 or hits[0] >= window:
        prompt = int(hits[0]) if hits.size else int(ids.size)
        raise ValueError(
            f"{where}: the prompt is {prompt} tokens, so no response token fits in train.seq_len="
            f"{window - 1}; raise train.seq_len or shorten the prompt"
        )
    cut = ids.size > window
    ids, trained = ids[:window], trained[:window]
    row = np.full(window, ~pad, dtype=np.int64)
    row[: ids.size] = np.where(trained, ids, ~ids)
    return row, cut


def pack_rows(examples: Sequence[np.ndarray], window: int, pad: int) -> np.ndarray:
    """Signed examples (``to_row``'s values, unpadded) packed back to back into one row of
    ``window`` tokens, each one's first token flagged with DOC_START (the model starts a document
    there: attention and RoPE positions stay within each example) and masked as a target (it is an
    input only, as at the start of an unpacked row). The padding after them is a document of its own."""
    row = np.full(window, ~pad, dtype=np.int64)
    at = 0
    for ex in examples:
        first = ex[0] if ex[0] >= 0 else ~ex[0]
        row[at : at + ex.size] = ex
        row[at] = ~(first | DOC_START)
        at += ex.size
    if at < window:
        row[at] = ~(pad | DOC_START)
    return row


class SFTWindows:
    """A ``WindowSource`` (framework.data.stream) of SFT rows in record order: one example each, or
    with ``pack`` (data.sft_pack) as many whole consecutive examples as fit. Its state is (epoch,
    record number of the next example not yet in a row): two integers, the same on every rank."""

    def __init__(
        self,
        files: Sequence[Path],
        fields: Fields,
        fmt: ChatFormat,
        window: int,
        keep: Callable[[int], bool],
        encode_batch: int = 256,
        label: str = "data",
        pack: bool = False,
    ) -> None:
        self.files, self.fields, self.fmt, self.window = list(files), fields, fmt, window
        self.pack = pack
        self.keep, self.encode_batch, self.label = keep, max(1, encode_batch), label
        self.pad = int(fmt.tok.eos_id)  # type: ignore[arg-type]  # ChatFormat refuses a tokenizer without EOS
        self.stamps = [FileStamp.of(f) for f in self.files]  # an edit mid-run: DataChanged (records.watched)
        self.seek({"epoch": 0, "record": 0})

    def seek(self, state: dict[str, int]) -> None:
        self._at = (int(state["epoch"]), int(state["record"]))
        self._gen = self._rows(*self._at)
        self._next: tuple[int, int, np.ndarray] | None = None  # read, not yet in a row (packing)

    def state(self) -> dict[str, int]:
        return {"epoch": self._at[0], "record": self._at[1]}

    def _rows(self, epoch: int, start: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """(epoch, next record number, row) for every kept record from ``start`` on, epoch after epoch."""
        while True:
            produced = False
            batch: list[tuple[int, str, list[dict]]] = []
            records = watched(read_records(self.files, self.fields, skip=start), self.stamps)
            for n, (where, msgs) in enumerate(records, start):
                if self.keep(n):
                    batch.append((n, where, msgs))
                if len(batch) >= self.encode_batch:
                    for item in self._encode(batch):
                        produced = True
                        yield (epoch, *item)
                    batch = []
            for item in self._encode(batch):
                produced = True
                yield (epoch, *item)
            if not produced and start == 0:
                raise ValueError(f"{self.label}: no SFT examples in this split")
            epoch, start = epoch + 1, 0

    def _encode(self, batch: list[tuple[int, str, list[dict]]]) -> list[tuple[int, np.ndarray]]:
        """(next record number, the example's signed row: padded to the window, or not when packing)."""
        encoded = self.fmt.encode_many([(w, m) for _, w, m in batch])
        out = []
        for (n, where, _), (ids, flags) in zip(batch, encoded, strict=True):
            row = to_row(ids, flags, self.window, self.pad, where)[0]
            out.append((n + 1, row[: min(ids.size, self.window)] if self.pack else row))
        return out

    def take(self, n: int) -> np.ndarray:
        rows = []
        for _ in range(n):
            if not self.pack:
                epoch, after, row = next(self._gen)
                self._at = (epoch, after)
                rows.append(row)
                continue
            examples, used = [], 0
            while True:
                if self._next is None:
                    self._next = next(self._gen)
                epoch, after, ex = self._next
                if examples and used + ex.size > self.window:
                    break  # it starts the next row; the state still points at it
                examples.append(ex)
                used += ex.size
                self._next, self._at = None, (epoch, after)
            rows.append(pack_rows(examples, self.window, self.pad))
        return np.stack(rows)


def check_sft(
    files: Sequence[Path], fields: Fields, fmt: ChatFormat, window: int, max_bytes: int
) -> int | None:
    """Read and encode every record (up to ``max_bytes`` of input; beyond it the first 1,000), so that a
    bad record is refused before launch; returns the number of records when all were read. Logs how
    many examples are cut to fit the row."""
    total = sum(f.stat().st_size for f in files)
    limit = None if total <= max_bytes else 1000
    n, cut, batch = 0, 0, []
    pad = int(fmt.tok.eos_id)  # type: ignore[arg-type]
    for where, msgs in read_records(files, fields):
        batch.append((where, msgs))
        n += 1
        if len(batch) >= 256 or (limit is not None and n >= limit):
            cut += _count_cut(batch, fmt, window, pad)
            batch = []
        if limit is not None and n >= limit:
            break
    cut += _count_cut(batch, fmt, window, pad)
    if n == 0:
        raise ValueError(f"data.path: {[str(f) for f in files][:4]} hold no SFT records")
    if cut:
        log.warning(
            "data=sft: %d of %d examples are longer than train.seq_len=%d; their responses are cut "
            "(the loss sees only what fits)",
            cut,
            n,
            window - 1,
        )
    return n if limit is None else None


def _count_cut(batch: list[tuple[str, list[dict]]], fmt: ChatFormat, window: int, pad: int) -> int:
    encoded = fmt.encode_many(batch)
    return sum(
        to_row(ids, flags, window, pad, where)[1]
        for (where, _), (ids, flags) in zip(batch, encoded, strict=True)
    )

"""Text -> token ids, behind one small interface that data, export and generation share.

Why one interface: the data pipeline encodes documents, the HF export writes the tokenizer next to
the weights, and ``framework.generate.decode`` decodes samples; each takes a ``Tokenizer`` and never asks
which kind it is. ``load_tokenizer`` builds one from the typed ``TokenizerConfig``.

Kinds: ``bytes`` (one token per UTF-8 byte, the embedded default), ``hf`` (a ``tokenizer.json`` of the
``tokenizers`` library: Llama-3's, or anything ``transformers``' ``save_pretrained`` writes) and
``sentencepiece`` (a ``tokenizer.model``, Llama-2 style). BOS/EOS are explicit: ``encode`` never adds
special tokens; the data pipeline appends ``eos_id`` after each document (and ``bos_id`` before it
with ``tokenizer.add_bos=true``). ``train_bpe`` trains a byte-level BPE offline.

A file tokenizer also carries what its folder says beside the vocabulary, read as transformers 5
reads it and written back the same way by ``save``: the chat template (``chat_template.jinja``,
which ``save_pretrained`` writes, before ``tokenizer_config.json``'s ``chat_template``) and the special
tokens (bos, eos, pad, unk: ``tokenizer_config.json``, else ``special_tokens_map.json``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from framework.config.schema import TokenizerConfig, TokenizerKind
from framework.data.folder_links import check_inside

log = logging.getLogger("framework")

# Names that tokenizers in the wild give their BOS / EOS tokens, in order of preference; used when no
# tokenizer_config.json names them and the config does not either.
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")
# What `tokenizer train` adds to the vocabulary (Llama-3's names: the HF export and AutoTokenizer
# recognise them through tokenizer_config.json).
TRAIN_BOS, TRAIN_EOS = "<|begin_of_text|>", "<|end_of_text|>"
# Where transformers 5's save_pretrained puts the chat template(s) (utils CHAT_TEMPLATE_FILE / _DIR);
# a file there wins over tokenizer_config.json's ``chat_template``, as in its from_pretrained.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
SPECIAL_TOKENS = ("bos", "eos", "pad", "unk")


class Tokenizer(Protocol):
    """What every tokenizer offers. ``bos_id``/``eos_id`` are None when the vocabulary has none."""

    kind: TokenizerKind
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    # The folder's default chat template (None: it has none), and its special tokens by role
    # (``SPECIAL_TOKENS``; a role it does not name is absent).
    chat_template: str | None
    special_tokens: dict[str, str]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, never with special tokens (the caller adds BOS/EOS explicitly)."""
        ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def token_id(self, token: str) -> int | None:
        """The id of one token of the vocabulary by its text (a special token's), or None."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def digest(self) -> str:
        """sha256 of what defines the vocabulary: token files record it, training compares it."""
        ...

    def save(self, out_dir: Path) -> list[str]:
        """Write files that ``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads; returns
        the file names written."""
        ...


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255); no special tokens, so the embedded default is unchanged."""

    kind = TokenizerKind.bytes
    vocab_size = 256
    bos_id: int | None = None
    eos_id: int | None = None
    chat_template: str | None = None
    special_tokens: dict[str, str] = {}  # noqa: RUF012 - read only

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def token_id(self, token: str) -> int | None:
        return None  # no special tokens

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def digest(self) -> str:
        return hashlib.sha256(b"framework.bytes/v1").hexdigest()

    def save(self, out_dir: Path) -> list[str]:
        """A byte-level ``tokenizers`` model whose id of each byte is the byte's value: BPE over
        GPT-2's byte alphabet with no merges, so every byte stays one token."""
        from tokenizers import Tokenizer as HFTok
        from tokenizers import decoders, models, pre_tokenizers

        vocab = {ch: b for b, ch in bytes_to_unicode().items()}
        tok = HFTok(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return _save_hf(tok, out_dir, {}, None, {})


class HFTokenizer:
    """A ``tokenizers`` JSON file (``tokenizer.json``), with BOS/EOS from the config, the file's
    ``tokenizer_config.json``, or well-known token names, in that order."""

    kind = TokenizerKind.hf

    def __init__(self, path: Path, bos_token: str | None, eos_token: str | None) -> None:
        from tokenizers import Tokenizer as HFTok

        self.path = path
        try:
            self.tok = HFTok.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for any parse error
            first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise ValueError(f"tokenizer.path={str(path)!r} is not a valid tokenizer.json ({first})") from e
        self.config: dict[str, Any] = {}
        self.chat_template: str | None = None
        if path.name == "tokenizer.json":  # a folder's: its side files describe it
            self.config = read_side_config(path.parent)
            self.chat_template = read_chat_template(path.parent, self.config)
        self.bos_token = self._special("bos", bos_token, BOS_NAMES)
        self.eos_token = self._special("eos", eos_token, EOS_NAMES)
        self.bos_id = None if self.bos_token is None else self.tok.token_to_id(self.bos_token)
        self.eos_id = None if self.eos_token is None else self.tok.token_to_id(self.eos_token)
        self.special_tokens = {"bos": self.bos_token, "eos": self.eos_token}
        for which in ("pad", "unk"):
            self.special_tokens[which] = self._special(which, None, ())
        self.special_tokens = {k: v for k, v in self.special_tokens.items() if v is not None}
        # Ids can have holes (added tokens past the base vocabulary): the embedding needs max id + 1.
        ids = self.tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(self.tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)

    def _special(self, which: str, configured: str | None, names: Sequence[str]) -> str | None:
        if configured is not None:
            if self.tok.token_to_id(configured) is None:
                added = [t.content for t in self.tok.get_added_tokens_decoder().values()][:8]
                raise ValueError(
                    f"tokenizer.{which}_token={configured!r} is not in the vocabulary of {self.path}; "
                    f"its special tokens include {added}"
                )
            return configured
        value = self.config.get(f"{which}_token")
        if isinstance(value, dict):  # transformers writes AddedToken as {"content": ...}
            value = value.get("content")
        if isinstance(value, str) and self.tok.token_to_id(value) is not None:
            return value
        return next((n for n in names if self.tok.token_to_id(n) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch_fast: no offsets; the Rust side spreads the batch over its thread pool.
        return [e.ids for e in self.tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def digest(self) -> str:
        vocab = self.tok.get_vocab(with_added_tokens=True)
        blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
        model = json.loads(self.tok.to_str()).get("model", {})
        return hashlib.sha256((blob + json.dumps(model.get("merges"))).encode()).hexdigest()

    def save(self, out_dir: Path) -> list[str]:
        extra = {k: self.config[k] for k in ("model_max_length", "add_bos_token") if k in self.config}
        return _save_hf(self.tok, out_dir, self.special_tokens, self.chat_template, extra)


class SentencePieceTokenizer:
    """A SentencePiece model (``tokenizer.model``, Llama-2 style); BOS/EOS from the model's own ids
    unless the config names other pieces."""

    kind = TokenizerKind.sentencepiece

    def __init__(self, path: Path, bos_token: str | None, eos_token: str | None) -> None:
        spm = needs("sentencepiece", "tokenizer=sentencepiece")

        self.path = path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            first = str(e).splitlines()[0][:200]
            raise ValueError(f"tokenizer.path={str(path)!r} is not a SentencePiece model ({first})") from e
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self._special("bos", bos_token, self.sp.bos_id())
        self.eos_id = self._special("eos", eos_token, self.sp.eos_id())
        ids = {"bos": self.bos_id, "eos": self.eos_id, "pad": self.sp.pad_id(), "unk": self.sp.unk_id()}
        self.special_tokens = {k: self.sp.id_to_piece(i) for k, i in ids.items() if i is not None and i >= 0}
        side = read_side_config(path.parent) if path.name == "tokenizer.model" else {}
        self.chat_template = read_chat_template(path.parent, side) if path.name == "tokenizer.model" else None

    def _special(self, which: str, configured: str | None, own: int) -> int | None:
        if configured is None:
            return own if own >= 0 else None
        i = self.sp.piece_to_id(configured)
        if self.sp.id_to_piece(i) != configured:
            raise ValueError(f"tokenizer.{which}_token={configured!r} is not a piece of {self.path}")
        return i

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts))

    def token_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def digest(self) -> str:
        return hashlib.sha256(self.sp.serialized_model_proto()).hexdigest()

    def save(self, out_dir: Path) -> list[str]:
        """tokenizer.model and a tokenizer_config.json naming the Llama tokenizer class and BOS/EOS
        (AutoTokenizer converts the model itself); plus a tokenizer.json, converted by transformers'
        Llama converter, when transformers is installed."""
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "tokenizer.model").write_bytes(self.sp.serialized_model_proto())
        tokens = {f"{k}_token": self.special_tokens.get(k) for k in SPECIAL_TOKENS}
        tokens = {k: v for k, v in tokens.items() if v is not None or k in ("bos_token", "eos_token")}
        config = {"tokenizer_class": "LlamaTokenizer", **tokens}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        written = ["tokenizer.model", "tokenizer_config.json"]
        if self.chat_template is not None:
            (out_dir / CHAT_TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")
            written.append(CHAT_TEMPLATE_FILE)
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return written
        AutoTokenizer.from_pretrained(out_dir).save_pretrained(out_dir)
        return sorted(
            {
                *written,
                *(p.name for p in out_dir.iterdir() if p.name.startswith(("tokenizer", "special", "chat"))),
            }
        )


def needs(module: str, what: str) -> Any:
    """Import an optional dependency, or a ValueError that says how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{what} needs the {module} package: pip install -e '.[data]'") from e


def _save_hf(
    tok: Any, out_dir: Path, special: dict[str, str], template: str | None, extra: dict[str, Any]
) -> list[str]:
    """tokenizer.json, tokenizer_config.json (the special tokens) and special_tokens_map.json, plus
    the chat template where transformers 5 reads it (``CHAT_TEMPLATE_FILE``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    tokens = {f"{k}_token": special.get(k) for k in SPECIAL_TOKENS if k in special or k in ("bos", "eos")}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokens,
        "clean_up_tokenization_spaces": False,
        **extra,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    mapped = {k: v for k, v in tokens.items() if v is not None}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(mapped, indent=2, ensure_ascii=False) + "\n")
    written = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    stale = out_dir / CHAT_TEMPLATE_FILE  # an earlier export's template must not outlive this one
    if template is not None:
        stale.write_text(template, encoding="utf-8")
        written.append(CHAT_TEMPLATE_FILE)
    elif stale.is_file():
        stale.unlink()
    return written


def read_side_config(folder: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` of a tokenizer folder ({} when absent), its missing special tokens
    filled from ``special_tokens_map.json`` (older folders name them only there). ValueError when
    either is not a JSON object."""
    config: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        side = folder / name
        if not side.is_file():
            continue
        try:
            blob = json.loads(side.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{side} is not valid JSON ({e})") from e
        if not isinstance(blob, dict):
            raise ValueError(f"{side} holds a {type(blob).__name__}; valid: a JSON object")
        if name == "tokenizer_config.json":
            config = blob
        else:
            keys = [f"{k}_token" for k in SPECIAL_TOKENS]
            config |= {k: blob[k] for k in keys if k in blob and k not in config}
    return config


def read_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The folder's default chat template, found where transformers 5 looks, in its order:
    ``chat_template.jinja``, ``additional_chat_templates/default.jinja``, then tokenizer_config.json's
    ``chat_template`` (a string, or a list of named templates: the one named ``default``). None when
    there is none at all; ValueError when there are templates but none is the default, or a file
    does not read as UTF-8 text: falling back to another format silently trained on other tokens."""
    named: dict[str, str] = {}
    value = config.get("chat_template")
    if isinstance(value, str):
        named["default"] = value
    elif isinstance(value, list):
        named |= {t["name"]: t.get("template") for t in value if isinstance(t, dict) and "name" in t}
    elif value is not None:
        raise ValueError(
            f"{folder / 'tokenizer_config.json'}: chat_template is a {type(value).__name__}; valid: a "
            "string or a list of {name, template}"
        )
    extra = folder / CHAT_TEMPLATE_DIR
    files = sorted(extra.glob("*.jinja")) if extra.is_dir() else []
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        files.append(folder / CHAT_TEMPLATE_FILE)
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat template {f} does not read as UTF-8 text ({e})") from None
        named["default" if f.name == CHAT_TEMPLATE_FILE else f.stem] = text
    if not named:
        return None
    template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ValueError(
            f"tokenizer folder {folder} has chat templates {sorted(named)[:8]} but no non-empty default "
            f"one; valid: a {CHAT_TEMPLATE_FILE}, or a template named 'default'"
        )
    return template


def resolve_path(kind: TokenizerKind, path: str | None) -> Path:
    """The tokenizer file ``tokenizer.path`` names (a folder holds ``tokenizer.json`` / ``tokenizer.model``)."""
    file_name = "tokenizer.json" if kind is TokenizerKind.hf else "tokenizer.model"
    if not path:
        raise ValueError(f"tokenizer={kind.value} needs tokenizer.path=<{file_name} or a folder holding it>")
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / file_name).is_file():
            found = sorted(q.name for q in p.iterdir())[:10]
            other = {TokenizerKind.hf: "sentencepiece", TokenizerKind.sentencepiece: "hf"}[kind]
            other_file = "tokenizer.model" if kind is TokenizerKind.hf else "tokenizer.json"
            hint = f" (a {other_file}: use tokenizer={other})" if (p / other_file).is_file() else ""
            raise ValueError(
                f"tokenizer.path={path!r} is a folder without {file_name}; it holds {found}{hint}"
            )
        for name in (file_name, "tokenizer_config.json"):  # the sidecar HFTokenizer reads too
            if (p / name).is_symlink():
                check_inside(p, name, f"tokenizer.path={path!r}")
        p = p / file_name
    if not p.is_file():
        raise ValueError(
            f"tokenizer.path={path!r} does not exist (valid: a {file_name} or a folder holding one)"
        )
    if p.stat().st_size == 0:
        raise ValueError(f"tokenizer.path={path!r} is an empty file")
    return p


def load_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """Build the configured tokenizer. Raises ValueError naming the value when it cannot be loaded."""
    if cfg.kind is TokenizerKind.bytes:
        if cfg.path or cfg.bos_token is not None or cfg.eos_token is not None:
            raise ValueError(
                "tokenizer=bytes has no file and no special tokens: drop tokenizer.path / bos_token / "
                "eos_token, or use tokenizer=hf|sentencepiece"
            )
        return ByteTokenizer()
    path = resolve_path(cfg.kind, cfg.path)
    if cfg.kind is TokenizerKind.hf:
        return HFTokenizer(path, cfg.bos_token, cfg.eos_token)
    return SentencePieceTokenizer(path, cfg.bos_token, cfg.eos_token)


def eos_fix(tok: Tokenizer, which: str = "eos") -> str:
    """What to do about a tokenizer without EOS (or BOS): tokenizer=bytes refuses
    tokenizer.eos_token / bos_token (it has no special tokens), so it is told to switch; a file
    tokenizer may name one."""
    if tok.kind is TokenizerKind.bytes:
        return "use tokenizer=hf|sentencepiece (bytes has no special tokens)"
    return f"set tokenizer.{which}_token to one of its tokens"


# A vocabulary padded up to a multiple of this is a recipe's choice, not a mistake (Megatron-LM's
# --make-vocab-size-divisible-by default): sft_tiny's 384 rows hold its tokenizer's 372 tokens.
VOCAB_PAD = 128


def check_vocab(
    tok: Tokenizer, model_vocab_size: int, init_from: str | None = None, reads_text: bool = True
) -> None:
    """A tokenizer whose ids do not fit the embedding is refused; a smaller one only warns (the
    embedding rows past it are never read, which wastes memory but is harmless). Under
    ``model.init_from`` the size is the checkpoint's, which no override may change: the fix is
    that model's own tokenizer.

    No warning for rows the tokenizer's vocabulary rounded up to a multiple of ``VOCAB_PAD`` leaves
    over, nor when no data source reads text (``reads_text=False``: ``data=synthetic`` draws ids
    over the whole ``model.vocab_size``, so every row trains; the large recipes benchmark so)."""
    if tok.vocab_size > model_vocab_size:
        fix = (
            f"the size of model.init_from={init_from!r}; use that model's own tokenizer"
            if init_from
            else f"set model.vocab_size>={tok.vocab_size} (or leave it unset: it then follows the tokenizer)"
        )
        raise ValueError(
            f"the tokenizer's vocabulary ({tok.vocab_size} tokens, tokenizer={tok.kind.value}) is larger "
            f"than model.vocab_size={model_vocab_size}: {fix}"
        )
    padded = -(-tok.vocab_size // VOCAB_PAD) * VOCAB_PAD
    if reads_text and model_vocab_size > padded:
        log.warning(
            "the tokenizer has %d tokens, model.vocab_size=%d: %d embedding rows are never used",
            tok.vocab_size,
            model_vocab_size,
            model_vocab_size - tok.vocab_size,
        )


def is_trained_bpe(path: Path) -> bool:
    """Whether ``path`` is a tokenizer ``train_bpe`` wrote (a BPE whose only added tokens are
    ``TRAIN_BOS``/``TRAIN_EOS``): ``tokenizer train`` replaces only such a file."""
    try:
        blob = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(blob, dict) or not isinstance(blob.get("model"), dict):
        return False
    added = [t.get("content") for t in blob.get("added_tokens") or [] if isinstance(t, dict)]
    return blob["model"].get("type") == "BPE" and added == [TRAIN_BOS, TRAIN_EOS]


def train_bpe(out: Path, texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 / Llama-3 style) with ``tokenizers``; writes ``out`` (JSON)."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = [TRAIN_BOS, TRAIN_EOS]
    if vocab_size < 256 + len(specials):
        raise ValueError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least {256 + len(specials)}")
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return HFTokenizer(out, TRAIN_BOS, TRAIN_EOS)

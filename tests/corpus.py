"""Small real corpora for the data and tokenizer tests, written offline from the stdlib's own source.

Documents are the first characters of standard-library modules: real text (code, docstrings,
comments) that every machine has, so a trained BPE has real merges to learn.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from framework.launch.data_cli import main as data_main

ROOT = Path(__file__).resolve().parent.parent


def documents(n: int, chars: int = 1500, start: int = 0) -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[start : start + n]
    return [f.read_text(encoding="utf-8", errors="replace")[:chars] for f in files]


@dataclass
class Corpus:
    root: Path
    docs: list[str]
    jsonl: Path
    text_dir: Path
    parquet: Path  # other documents than docs
    bpe: Path  # a trained byte-level BPE tokenizer.json (vocab 512)


def write_corpus(root: Path, n: int = 60) -> Corpus:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    docs = documents(n)
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    text_dir = root / "txt"
    text_dir.mkdir(exist_ok=True)
    for i, d in enumerate(docs[:20]):
        (text_dir / f"doc{i:03d}.txt").write_text(d)
    parquet = root / "docs.parquet"
    other = documents(n, start=n)  # other documents than the jsonl's: a mix of both repeats nothing
    pq.write_table(pa.table({"text": other, "id": list(range(n))}), parquet, row_group_size=8)
    (root / "small.txt").write_text(docs[0][:600])  # a few windows: the stream wraps into new epochs
    bpe = root / "bpe.json"
    assert data_main(["tokenizer", "train", str(bpe), str(jsonl), "--vocab-size", "512"]) == 0
    return Corpus(root, docs, jsonl, text_dir, parquet, bpe)

"""Data: byte-level text with a content fingerprint, seeded synthetic tokens, deterministic batches."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ablate.config.schema import ConfigError, DataConfig, DataSource
from trainers.data import SyntheticSource, TextSource, build_source, resolve_text_files

CORPUS = Path(__file__).resolve().parent.parent / "assets" / "corpus"


def test_text_fingerprint_is_content_based(tmp_path: Path) -> None:
    base = TextSource(str(CORPUS), seed=1, vocab_size=256)
    assert base.fingerprint.startswith("sha256:")
    assert len(base.files) == 2 and base.num_tokens > 3000
    # Same bytes elsewhere (a copy on another node) -> same fingerprint; a glob selecting the same files too.
    copy = tmp_path / "copy"
    shutil.copytree(CORPUS, copy)
    assert TextSource(str(copy), seed=1, vocab_size=256).fingerprint == base.fingerprint
    assert TextSource(str(copy / "*"), seed=1, vocab_size=256).fingerprint == base.fingerprint
    # One changed byte -> a different fingerprint.
    target = copy / "notes_on_rivers.md"
    data = bytearray(target.read_bytes())
    data[10] ^= 1
    target.write_bytes(bytes(data))
    assert TextSource(str(copy), seed=1, vocab_size=256).fingerprint != base.fingerprint
    # A single file is a different corpus.
    assert TextSource(str(CORPUS / "on_measuring.txt"), seed=1, vocab_size=256).fingerprint != base.fingerprint


def test_text_batches_are_bytes_shifted_by_one_and_deterministic() -> None:
    source = TextSource(str(CORPUS), seed=7, vocab_size=256)
    tokens, targets = source.batch(step=3, micro=0, rank=1, micro_batch=2, seq_len=32)
    assert tokens.shape == targets.shape == (2, 32)
    assert (tokens[:, 1:] == targets[:, :-1]).all()
    assert int(tokens.max()) < 256
    again, _ = source.batch(step=3, micro=0, rank=1, micro_batch=2, seq_len=32)
    other, _ = source.batch(step=3, micro=0, rank=0, micro_batch=2, seq_len=32)
    assert (again == tokens).all() and not (other == tokens).all()
    text = bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
    corpus = b"\n".join(p.read_bytes() for p in sorted(CORPUS.iterdir())).decode()
    assert text in corpus


def test_synthetic_is_seeded_and_fingerprinted_by_config() -> None:
    a, b = SyntheticSource(1, 256), SyntheticSource(1, 256)
    assert a.fingerprint == b.fingerprint != SyntheticSource(2, 256).fingerprint
    assert (a.batch(0, 0, 0, 2, 16)[0] == b.batch(0, 0, 0, 2, 16)[0]).all()
    assert not (a.batch(0, 0, 0, 2, 16)[0] == a.batch(1, 0, 0, 2, 16)[0]).all()


def test_bad_text_paths_and_vocab_fail_with_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lane.data.path"):
        resolve_text_files(str(tmp_path / "nothing-*.txt"))
    with pytest.raises(ConfigError, match="lane.model.vocab_size"):
        TextSource(str(CORPUS), seed=0, vocab_size=128)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("short")
    with pytest.raises(ConfigError, match="seq_len"):
        build_source(DataConfig(source=DataSource.text, path=str(tiny)), 256).batch(0, 0, 0, 1, 64)

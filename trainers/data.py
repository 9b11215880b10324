"""Batches for one arm: seeded synthetic tokens or byte-level tokens from real text on disk.

How to use::

    source = build_source(lane.data, vocab_size=lane.model.vocab_size)
    source.fingerprint                      # same data config -> same fingerprint, in both arms of a block
    tokens_BT, targets_BT = source.batch(step=3, micro=0, rank=0, micro_batch=2, seq_len=64)

A batch is a pure function of (seed, step, micro-step, rank): both arms of a block see the same tokens at the
same step whatever ran before, and a retried attempt replays the same stream. Text is read once into memory
(the corpora here are small); tokens are raw bytes, so no tokenizer download is needed and vocab_size >= 256.

Shape legend: B = micro-batch, T = sequence length.
"""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path
from typing import Optional

import torch

from ablate.config.schema import ConfigError, DataConfig, DataSource

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
"""Files taken from a directory given as ``lane.data.path``."""


def _mix(*parts: int) -> int:
    # A stable 63-bit seed from the batch coordinates; Python's hash() is salted per process.
    digest = hashlib.blake2b(json.dumps(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class SyntheticSource:
    """Uniform random tokens from a seeded generator: exercises the model, carries no signal."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.seed, self.vocab_size = seed, vocab_size
        self.fingerprint = "synthetic:" + hashlib.sha256(
            json.dumps({"seed": seed, "vocab_size": vocab_size}).encode()).hexdigest()[:16]
        self.files: list[str] = []
        self.num_tokens: Optional[int] = None

    def batch(self, step: int, micro: int, rank: int, micro_batch: int, seq_len: int) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
        generator = torch.Generator().manual_seed(_mix(self.seed, step, micro, rank))
        seq_BT = torch.randint(0, self.vocab_size, (micro_batch, seq_len + 1), generator=generator)
        return seq_BT[:, :-1], seq_BT[:, 1:]


def resolve_text_files(path: str) -> list[Path]:
    """A file, a directory (its text files, recursively) or a glob; sorted so the order is stable."""
    candidate = Path(path).expanduser()
    if candidate.is_file():
        return [candidate]
    if candidate.is_dir():
        files = [p for p in candidate.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
    else:
        files = [Path(p) for p in glob.glob(str(candidate), recursive=True) if Path(p).is_file()]
    if not files:
        raise ConfigError("lane.data.path", path, f"a file, a directory with {', '.join(TEXT_SUFFIXES)} files, or a "
                                                  "glob matching at least one file")
    return sorted(files)


class TextSource:
    """Byte-level tokens from text files; random windows chosen by the seeded batch coordinates."""

    def __init__(self, path: str, seed: int, vocab_size: int) -> None:
        if vocab_size < 256:
            raise ConfigError("lane.model.vocab_size", vocab_size, "at least 256 for byte-level text data")
        self.seed = seed
        paths = resolve_text_files(path)
        contents = [p.read_bytes() for p in paths]
        # Content-only fingerprint (per-file digests in path order): the same corpus copied to another
        # directory or node fingerprints the same; any changed byte does not.
        outer = hashlib.sha256()
        for content in contents:
            outer.update(hashlib.sha256(content).digest())
        self.fingerprint = "sha256:" + outer.hexdigest()
        self.files = [str(p) for p in paths]
        joined = b"\n".join(contents)
        self.tokens = torch.frombuffer(bytearray(joined), dtype=torch.uint8).to(torch.long)
        self.num_tokens = int(self.tokens.numel())

    def batch(self, step: int, micro: int, rank: int, micro_batch: int, seq_len: int) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
        span = seq_len + 1
        if self.num_tokens < span:
            raise ConfigError("lane.data.path", self.files, f"text with at least seq_len + 1 = {span} bytes "
                                                            f"(got {self.num_tokens})")
        generator = torch.Generator().manual_seed(_mix(self.seed, step, micro, rank))
        starts = torch.randint(0, self.num_tokens - span + 1, (micro_batch,), generator=generator)
        seq_BT = torch.stack([self.tokens[s:s + span] for s in starts.tolist()])
        return seq_BT[:, :-1], seq_BT[:, 1:]


Source = SyntheticSource | TextSource


def build_source(config: DataConfig, vocab_size: int) -> Source:
    if config.source is DataSource.text:
        assert config.path is not None, "LaneConfig.__post_init__ requires data.path for text"
        return TextSource(config.path, config.seed, vocab_size)
    return SyntheticSource(config.seed, vocab_size)


def fingerprint_of(config: DataConfig, vocab_size: int) -> str:
    """The data fingerprint without keeping the tokens (for receipts written outside the worker)."""
    return build_source(config, vocab_size).fingerprint

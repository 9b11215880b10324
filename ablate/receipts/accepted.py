"""Receipt payloads this machine has already checked and accepted, so reading the same store again skips their
checks.

Why: checking a receipt (schema, re-derived figures, digest) is ~0.8 ms of pure Python, and every ``ablate promote``
reads the whole experiment again: 10,000 receipts were 7 s of a 25 s promotion on two cores, almost all of them
receipts the previous promotion had already checked.

Why it is exact: whether a payload is a valid receipt depends only on its bytes and on the code that checks them.
An entry is the sha256 of the exact payload bytes, in a file named by the checking code's fingerprint (the source
of the validator and of the payload reader, the Python and pydantic versions): other bytes or other code never hit.
Only payloads that are exactly the accepted model's own JSON are kept (``bulk_read._check_result``), so the reader
rebuilds the very model that was checked; only acceptances are kept (a refused payload is checked again, and says why, every time). The one check
that depends on the clock, a ``created_at`` in the future, only ever turns from refused to accepted. A hit still
parses the payload into its model and checks it against its run's tags (``bulk_read``).

The file lives in ``$ABLATE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/ablate``, else ``~/.cache/ablate``); ``off``
turns it off. It is trusted like the installed code beside it: whoever can write one can write the other. An
unreadable or damaged file counts as empty; one that cannot be written is left as it is.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Optional

CACHE_ENV = "ABLATE_CACHE_DIR"
OFF = "off"
_MAGIC = b"ablate-accepted-receipts 1\n"
_DIGEST_BYTES = 32
_CHECKING_CODE = ("ablate/receipts/schema.py", "ablate/receipts/derive.py", "ablate/receipts/store.py",
                  "ablate/tracking/payload.py", "ablate/tracking/bulk_read.py")
"""What decides whether a payload is accepted: the validator, the derivations it re-computes, the digest check,
the payload decoder and the parse in the reader."""


def cache_dir() -> Optional[Path]:
    configured = os.environ.get(CACHE_ENV, "").strip()
    if configured.lower() == OFF:
        return None
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "ablate"


def checking_fingerprint() -> str:
    import pydantic
    import pydantic_core

    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for name in _CHECKING_CODE:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    for version in (sys.version, pydantic.VERSION, pydantic_core.__version__):
        digest.update(version.encode() + b"\0")
    return digest.hexdigest()[:20]


def payload_key(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class AcceptedPayloads:
    """The keys (``payload_key``) of payloads accepted under this checking code; ``add`` then ``save``."""

    def __init__(self, path: Optional[Path]) -> None:
        self.path = path
        self._known = _read(path) if path is not None else set()
        self._new: set[bytes] = set()

    @classmethod
    def open(cls) -> "AcceptedPayloads":
        directory = cache_dir()
        return cls(None if directory is None else directory / f"accepted-{checking_fingerprint()}.bin")

    def __contains__(self, key: bytes) -> bool:
        return key in self._known

    def add(self, keys: Iterable[bytes]) -> None:
        self._new.update(key for key in keys if key not in self._known)

    def save(self) -> None:
        """Writes the new keys beside those already in the file (another reader may have added some since it was
        opened); atomically, so a reader never sees half a file."""
        if self.path is None or not self._new:
            return
        keys = _read(self.path) | self._known | self._new
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.path.parent, prefix=".accepted-", delete=False) as handle:
                handle.write(_MAGIC + b"".join(sorted(keys)))
            os.replace(handle.name, self.path)
        except OSError:  # read-only or full cache directory: the next read checks everything again
            try:
                os.unlink(handle.name)
            except (OSError, UnboundLocalError):
                pass
            return
        self._known, self._new = keys, set()


def _read(path: Path) -> set[bytes]:
    try:
        data = path.read_bytes()
    except OSError:
        return set()
    body = data[len(_MAGIC):]
    if not data.startswith(_MAGIC) or len(body) % _DIGEST_BYTES:
        return set()  # damaged or another format: as if empty, rewritten whole on the next save
    return {body[i:i + _DIGEST_BYTES] for i in range(0, len(body), _DIGEST_BYTES)}

"""Secret hygiene shared by every place that writes outside the process (receipts, MLflow, logs, the CLI).

Two rules: environment variables reach a receipt only through an allowlist, and anything that looks like a
secret (by name, or credentials inside a URI) is redacted even when allowlisted. Free text (error messages,
log lines) gets a last pass that removes the values of secret-named variables wherever they appear.
"""

from __future__ import annotations

import fnmatch
import os
import re
from typing import Mapping, Optional

REDACTED = "<redacted>"

ENV_ALLOWLIST: tuple[str, ...] = (
    "CUDA_*", "NCCL_*", "NVIDIA_*", "CUBLAS_*", "CUDNN_*", "PYTORCH_*", "TORCH_*", "TORCHINDUCTOR_*",
    "TORCHDYNAMO_*", "TRITON_*", "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS", "KMP_*", "GLOO_*", "DS_*", "DEEPSPEED_*", "RAY_TRAIN_*", "MLFLOW_TRACKING_URI",
    "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT", "ABLATE_*",
)
"""Glob patterns of variable names that describe the runtime. Anything else never reaches a receipt."""

SECRET_NAME_PATTERNS: tuple[str, ...] = ("*TOKEN*", "*SECRET*", "*PASSWORD*", "*PASSWD*", "*KEY*", "*CREDENTIAL*",
                                         "*AUTH*", "*COOKIE*", "*SESSION*")
"""A name matching one of these keeps its name in the receipt but never its value."""

_URI_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/@\s]+)@")
_SECRET_QUERY = re.compile(
    r"(?i)([?&][^=&\s]*(?:token|key|secret|password|passwd|signature|credential|auth)[^=&\s]*=)[^&\s]+")


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, pattern) for pattern in patterns)


def is_secret_name(name: str) -> bool:
    return _matches(name, SECRET_NAME_PATTERNS)


def redact_uri(value: str) -> str:
    """Strip credentials embedded in a value: ``scheme://user:pw@host`` and ``?token=...`` query parameters."""
    value = _URI_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", value)
    return _SECRET_QUERY.sub(lambda m: f"{m.group(1)}{REDACTED}", value)


def redact_text(text: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """Redact free text (an error message, a log line) of URI credentials and the values of secret variables.

    Error messages can quote a URI or an environment value verbatim; this is the last line of defence.
    """
    text = redact_uri(text)
    environ = os.environ if environ is None else environ
    for name, value in environ.items():
        if len(value) >= 6 and is_secret_name(name) and value in text:
            text = text.replace(value, REDACTED)
    return text


def capture_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Allowlisted runtime variables with secret names and embedded credentials redacted."""
    environ = os.environ if environ is None else environ
    captured: dict[str, str] = {}
    for name in sorted(environ):
        if not _matches(name, ENV_ALLOWLIST):
            continue
        captured[name] = REDACTED if is_secret_name(name) else redact_uri(environ[name])
    return captured

"""Secret hygiene shared by every place that writes outside the process (receipts, MLflow, logs, the CLI).

Two rules: environment variables reach a receipt only through an allowlist, and anything that looks like a
secret (by name, or a URI carrying ``user:password@``) is redacted even when allowlisted.
"""

from __future__ import annotations

import re
from typing import Mapping

REDACTED = "***"

ENV_ALLOWLIST_PREFIXES = ("CUDA_", "NCCL_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "OMP_", "MKL_", "KMP_",
                          "TRITON_", "DS_", "RAY_", "MLFLOW_", "ABLATE_", "NVIDIA_", "GLOO_")
ENV_ALLOWLIST_EXACT = frozenset({"WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"})
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL|AUTH|COOKIE|SIGNATURE|SESSION)",
                         re.IGNORECASE)
_URI_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]*)@")
_QUERY_SECRET = re.compile(r"(?P<k>[?&](?:token|access_token|key|apikey|api_key|password|secret|sig|signature)=)"
                           r"(?P<v>[^&\s]+)", re.IGNORECASE)


def redact_uri(text: str) -> str:
    """Mask ``user:password@`` in URIs and secret-looking query parameters."""
    text = _URI_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['k']}{REDACTED}", text)


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def safe_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The allowlisted part of an environment, with secret-named values and URI passwords masked."""
    kept: dict[str, str] = {}
    for name, value in sorted(environ.items()):
        if not (name.startswith(ENV_ALLOWLIST_PREFIXES) or name in ENV_ALLOWLIST_EXACT):
            continue
        kept[name] = REDACTED if is_secret_name(name) else redact_uri(value)
    return kept


def scrub(text: str, environ: Mapping[str, str]) -> str:
    """Replace any secret value from ``environ`` that appears verbatim in ``text`` (log lines, error messages)."""
    for name, value in environ.items():
        if is_secret_name(name) and len(value) >= 6:
            text = text.replace(value, REDACTED)
    return redact_uri(text)

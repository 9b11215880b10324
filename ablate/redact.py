"""Secret hygiene shared by every place that writes outside the process (receipts, MLflow, logs, the CLI) and
every process we start or hand to Ray.

Three rules:
1. Environment variables reach a receipt only through an allowlist (``ENV_ALLOWLIST``), and a name that looks
   like a secret (``is_secret_name``: PASS, PWD, PAT, KEY, SECRET, TOKEN, CREDENTIAL, AUTH, ... as a word of the
   name) keeps its name there but never its value, whatever its prefix (``ABLATE_API_PASS`` included).
2. Processes we start (an arm's worker, Ray's own processes on a local runtime, Tune's trial actors) get only
   ``process_env``: what a process needs to run (``PATH``, ``HOME``, ``RAY_*``, ...) plus the allowlist, never a
   secret-named variable, and URIs with their credentials redacted. Credentials travel by reference only
   (``AWS_PROFILE``, ``GOOGLE_APPLICATION_CREDENTIALS`` name a profile or a file, never hold the key).
3. Free text (error messages, log lines) gets a last pass that removes credentials inside URIs and the values of
   secret-named variables wherever they appear, URL-encoded forms included.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional
from urllib.parse import quote

REDACTED = "<redacted>"

ENV_ALLOWLIST: tuple[str, ...] = (
    "CUDA_*", "NCCL_*", "NVIDIA_*", "CUBLAS_*", "CUDNN_*", "PYTORCH_*", "TORCH_*", "TORCHINDUCTOR_*",
    "TORCHDYNAMO_*", "TRITON_*", "OMP_*", "GOMP_*", "MKL_*", "OPENBLAS_*", "ONEDNN_*", "DNNL_*", "MALLOC_*",
    "PYTHONMALLOC", "LD_PRELOAD", "KMP_*", "GLOO_*", "DS_*", "DEEPSPEED_*", "RAY_TRAIN_*", "MLFLOW_TRACKING_URI",
    "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT", "ABLATE_*",
)
"""Glob patterns of variable names that describe the runtime. Anything else never reaches a receipt. The thread
pools', BLAS/oneDNN and allocator families are all here, not only their thread counts: every arm inherits them
(``PROCESS_ENV_BASE``) and they change speed (``DNNL_DEFAULT_FPMATH_MODE=BF16`` runs fp32 matmuls in bf16,
``OMP_WAIT_POLICY`` and ``MALLOC_ARENA_MAX`` move step times), so a receipt must show what its arm ran with.
``LD_PRELOAD`` too: a cluster that preloads jemalloc or tcmalloc for its raylet trains with that allocator, and an
arm started without it (a forked rank, a one-worker arm) measured glibc's instead, with nothing in its receipt."""

PROCESS_ENV_BASE: tuple[str, ...] = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ", "TERM", "HOSTNAME",
    "TMPDIR", "TMP", "TEMP", "XDG_*", "LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH", "CC", "CXX", "NVCC_*",
    "MAX_JOBS", "VIRTUAL_ENV", "CONDA_*", "PYTHON*", "RAY_*", "TUNE_*", "ROCM_*", "HIP_*", "HSA_*",
    "ROCR_VISIBLE_DEVICES", "MALLOC_*", "OMP_*", "GOMP_*", "MKL_*", "OPENBLAS_*", "ONEDNN_*", "DNNL_*", "HF_HOME",
    "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "NO_PROXY",
    "no_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
)
"""Names a process needs to start and run (interpreter, locale, temp dirs, compilers, Ray's own settings) that
say nothing about a measurement, so receipts leave them out; ``process_env`` passes them on."""

CREDENTIAL_REFERENCES: tuple[str, ...] = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE", "AWS_ENDPOINT_URL*", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT",
    "RAY_TLS_*",
)
"""Names that point at credentials (a profile, a region, a file path) instead of holding them: storage on S3/GCS
and a TLS-enabled Ray keep working in processes we start, while the keys themselves (``AWS_SECRET_ACCESS_KEY``)
stay behind. Receipts still leave them out (not allowlisted)."""

SECRET_WORDS: tuple[str, ...] = (
    "PASS", "PASSWORD", "PASSWD", "PASSPHRASE", "PWD", "PW", "PAT", "KEY", "KEYS", "APIKEY", "SECRET", "SECRETS",
    "TOKEN", "TOKENS", "CREDENTIAL", "CREDENTIALS", "CRED", "CREDS", "AUTH", "OAUTH", "COOKIE", "COOKIES",
    "SESSION", "SIGNATURE", "SIG", "JWT", "BEARER", "OTP", "DSN", "PRIVATE", "SAS",
)
"""A name is secret when one of its words (split on ``_``, ``-``, ``.``) is one of these ..."""
SECRET_SUFFIXES: tuple[str, ...] = ("PASS", "PASSWORD", "PASSWD", "PWD", "KEY", "SECRET", "TOKEN", "AUTH",
                                    "CREDENTIALS")
"""... or ends with one of these (``DBPASS``, ``APITOKEN``, ``SECRETKEY``) ..."""
SECRET_INFIXES: tuple[str, ...] = ("PASSWORD", "PASSWD", "PASSPHRASE", "SECRET", "CREDENTIAL", "APIKEY", "TOKEN")
"""... or contains one of these anywhere (``MYPASSWORDFILE``, ``GHTOKENV2``)."""
NOT_SECRET: tuple[str, ...] = (
    "TOKENIZERS_PARALLELISM", "TORCHINDUCTOR_DISABLED_PASSES", "CUDA_POINTER_ATTRIBUTE_P2P_TOKENS",
    "TORCH_COMPILE_CACHE_KEY_TAG", "TORCH_COMPILE_STICKY_PGO_KEY", "TRITON_REDIS_KEY_FORMAT", "PWD", "OLDPWD",
)
"""Runtime knobs whose names only look like secrets; an arm must see them as the user set them. ``PWD`` and
``OLDPWD`` are the shell's working directories: as secrets, every path under them in a report or an error
message would read ``<redacted>/...``."""

_WORD_SPLIT = re.compile(r"[_\-.]+")

# userinfo ends at the LAST '@' that is followed by a host[:port] and then the end of the URI: a password may hold
# '@', ':', '/', '%' or any non-space character. A user name has no '/' or ':' (it may hold '@', an e-mail
# address), so ``host/path@tag`` without a colon is left alone. Quotes, angle brackets and the punctuation
# that follows a URI in prose (``(http://u:pw@host:5000)``, ``host:5000, ...``) end it in free text.
_URI_USERINFO = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)"
    r"(?P<userinfo>[^\s/:\"'<>`]*(?::[^\s\"'<>`]*)?)"
    r"@(?P<host>\[[0-9A-Fa-f:.]*\]|[^\s/?#@:\[\]\"'<>`]*)(?P<port>:[0-9]*)?"
    r"(?=[/?#\s\"'<>`),;\]]|$)")
_SECRET_QUERY = re.compile(
    r"(?i)([?&;](?:[^=&\s]*(?:token|key|secret|pass|pwd|signature|credential|auth|session)[^=&\s]*|sig)=)"
    r"[^&#\s\"'<>`]+")


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    matcher = _any_of(patterns)
    return matcher(name) is not None or matcher(name.upper()) is not None


@functools.lru_cache(maxsize=16)
def _any_of(patterns: tuple[str, ...]) -> Callable[[str], Any]:
    # One regex for the whole list (``fnmatchcase`` is a full match of ``fnmatch.translate``): the environment is
    # classified for every arm, ~60 names against ~40 patterns, twice each, and one fnmatch call per pair was
    # ~7% of a trial process's CPU in the 1,000-block benchmark.
    return re.compile("|".join(f"(?:{fnmatch.translate(pattern)})" for pattern in patterns) or "(?!)").match


def is_secret_name(name: str) -> bool:
    """True for a variable name that says it holds a secret (see ``SECRET_WORDS``); over-matching only costs a
    redacted value, under-matching leaks one."""
    upper = name.upper()
    if upper in NOT_SECRET:
        return False
    words = [w for w in _WORD_SPLIT.split(upper) if w]
    return (any(w in SECRET_WORDS or w.endswith(SECRET_SUFFIXES) for w in words)
            or any(infix in upper for infix in SECRET_INFIXES))


def redact_uri(value: str) -> str:
    """Strip credentials embedded in a value: ``scheme://user:pw@host`` (a password may itself hold ``@``, ``:``
    or ``/``) and ``?token=...``-like query parameters."""
    value = _URI_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@{m.group('host')}{m.group('port') or ''}",
                              value)
    return _SECRET_QUERY.sub(lambda m: f"{m.group(1)}{REDACTED}", value)


def _encoded_forms(value: str) -> set[str]:
    return {value, quote(value, safe=""), quote(value), quote(value, safe="").replace("%20", "+")}


def _secret_forms(environ: Mapping[str, str]) -> tuple[str, ...]:
    forms: set[str] = set()
    for name, value in environ.items():
        if len(value) >= 6 and is_secret_name(name) and not _matches(name, CREDENTIAL_REFERENCES):
            forms |= _encoded_forms(value)
    # Longest first: a value that contains another secret is removed whole, not left in pieces around it.
    return tuple(sorted(forms, key=len, reverse=True))


def text_redactor(environ: Optional[Mapping[str, str]] = None) -> Callable[[str], str]:
    """``redact_text`` with the environment read once, for a renderer that redacts every cell it writes: reading
    and classifying the environment is ~150 us, most of a call, and a large report renders thousands of cells."""
    forms = _secret_forms(os.environ if environ is None else environ)

    def redact(text: str) -> str:
        text = redact_uri(text)
        for form in forms:
            text = text.replace(form, REDACTED)
        return text

    return redact


def redact_text(text: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """Redact free text (an error message, a log line) of URI credentials and the values of secret variables.

    Error messages can quote a URI or an environment value verbatim; this is the last line of defence.
    """
    return text_redactor(environ)(text)


def capture_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Allowlisted runtime variables with secret names and embedded credentials redacted."""
    environ = os.environ if environ is None else environ
    captured: dict[str, str] = {}
    for name in sorted(environ):
        if not _matches(name, ENV_ALLOWLIST):
            continue
        captured[name] = REDACTED if is_secret_name(name) else redact_uri(environ[name])
    return captured


def process_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment a process we start (or Ray starts for us) may inherit: ``PROCESS_ENV_BASE``,
    ``ENV_ALLOWLIST`` and ``CREDENTIAL_REFERENCES``, without secret-named variables, URIs without credentials."""
    environ = os.environ if environ is None else environ
    kept: dict[str, str] = {}
    for name, value in environ.items():
        if _matches(name, CREDENTIAL_REFERENCES):
            kept[name] = redact_uri(value)
        elif _matches(name, PROCESS_ENV_BASE + ENV_ALLOWLIST) and not is_secret_name(name):
            kept[name] = redact_uri(value)
    return kept


def withheld(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Names ``process_env`` drops from ``environ`` (for a log line: names only, never values)."""
    environ = os.environ if environ is None else environ
    kept = process_env(environ)
    return sorted(name for name in environ if name not in kept)


@contextmanager
def process_env_only() -> Iterator[None]:
    """Around ``ray.init`` of a local runtime: Ray's processes (GCS, raylet, agents, and every worker the raylet
    forks later, so every trial and arm) inherit this process's environment, a driver's secrets included. For the
    duration ``os.environ`` holds only ``process_env``; afterwards the caller gets its own environment back (plus
    anything set meanwhile, e.g. by ``ray.init``). Nothing else may run in this process meanwhile."""
    saved = dict(os.environ)
    scrubbed = process_env(saved)
    os.environ.clear()
    os.environ.update(scrubbed)
    try:
        yield
    finally:
        added = {name: value for name, value in os.environ.items() if scrubbed.get(name) != value}
        os.environ.clear()
        os.environ.update(saved)
        os.environ.update(added)

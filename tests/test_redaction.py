"""Secrets never leave the process. Environment capture: an allowlist first, then redaction of secret names and
credentials inside values; processes we start (arms, a local Ray, Tune's trial actors) inherit no secret."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ablate.redact import (REDACTED, capture_env, is_secret_name, process_env, process_env_only, redact_text,
                           redact_uri)

PLANTED = {
    "NCCL_DEBUG": "INFO",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "OMP_NUM_THREADS": "2",
    "TORCH_HUB_TOKEN": "hf_tok_3f9a1c77e2",                      # allowlisted prefix, secret name
    "NCCL_IB_SECRET_KEY": "nccl-secret-88c1",                     # allowlisted prefix, secret name
    "MLFLOW_TRACKING_URI": "https://alice:pa55w0rd-xyz@mlflow.internal:5000",  # credentials in a URI
    "TORCHINDUCTOR_CACHE_URL": "s3://bucket/cache?X-Amz-Signature=sig0123456789&region=eu",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-55d2e1",                 # not allowlisted at all
    "HOME": "/root",
}


def test_allowlist_then_redaction() -> None:
    env = capture_env(PLANTED)
    assert env["NCCL_DEBUG"] == "INFO" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["OMP_NUM_THREADS"] == "2"
    assert env["TORCH_HUB_TOKEN"] == REDACTED and env["NCCL_IB_SECRET_KEY"] == REDACTED
    assert env["MLFLOW_TRACKING_URI"] == f"https://{REDACTED}@mlflow.internal:5000"
    assert "sig0123456789" not in env["TORCHINDUCTOR_CACHE_URL"] and "region=eu" in env["TORCHINDUCTOR_CACHE_URL"]
    assert "AWS_SECRET_ACCESS_KEY" not in env and "HOME" not in env
    blob = repr(env)
    for secret in ("hf_tok_3f9a1c77e2", "nccl-secret-88c1", "pa55w0rd-xyz", "aws-secret-55d2e1", "sig0123456789"):
        assert secret not in blob


def test_free_text_redaction_for_error_messages() -> None:
    message = "connect failed: postgresql://bob:hunter2-long@db:5432/x (key aws-secret-55d2e1)"
    cleaned = redact_text(message, PLANTED)
    assert "hunter2-long" not in cleaned and "aws-secret-55d2e1" not in cleaned
    assert redact_uri("http://host:80/path") == "http://host:80/path"


def test_uri_passwords_and_query_tokens_are_masked() -> None:
    uri = "postgresql://mlflow:hunter2pass@db.internal:5432/mlflow?sslmode=require&token=abc123xyz"
    out = redact_uri(uri)
    assert "hunter2pass" not in out and "abc123xyz" not in out
    assert out.startswith(f"postgresql://{REDACTED}@db.internal:5432/mlflow?sslmode=require")


# --- issue 17: secret names under every allowlisted prefix, '@' in URI passwords, what processes inherit ---
DRIVER_SECRETS = {
    "ABLATE_API_PASS": "ablate-pass-0c4f7e", "ABLATE_DB_PWD": "ablate-pwd-9b2d1a", "ABLATE_TEST_TOKEN": "tok-5e6f7a",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-3c2b1a", "HF_TOKEN": "hf_planted_8d7c6b", "WANDB_API_KEY": "wandb-4a3b2c",
    "DB_PASSWORD": "db-pass-1f2e3d", "GITHUB_PAT": "ghp_planted_77aa", "TORCH_HUB_TOKEN": "torch-hub-66bb",
    "RAY_AUTH_TOKEN_SECRET": "ray-secret-55cc", "ABLATE_OAUTH": "oauth-planted-44dd",
}
RUNTIME = {"PATH": "/usr/bin", "HOME": "/root", "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false",
           "TORCHINDUCTOR_DISABLED_PASSES": "x", "CUDA_VISIBLE_DEVICES": "0", "ABLATE_WAIT_FOR_NODES_S": "0",
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "AWS_PROFILE": "ci", "ABLATE_PATTERN": "AEMR"}


def test_secret_names_are_caught_under_every_allowlisted_prefix() -> None:
    assert all(is_secret_name(name) for name in DRIVER_SECRETS)
    assert not any(is_secret_name(name) for name in RUNTIME if name != "AWS_PROFILE")
    env = capture_env({**DRIVER_SECRETS, **RUNTIME})
    for name in ("ABLATE_API_PASS", "ABLATE_DB_PWD", "ABLATE_TEST_TOKEN", "TORCH_HUB_TOKEN", "ABLATE_OAUTH"):
        assert env[name] == REDACTED, name
    assert env["ABLATE_WAIT_FOR_NODES_S"] == "0" and env["TORCHINDUCTOR_DISABLED_PASSES"] == "x"
    assert "PATH" not in env and "AWS_PROFILE" not in env and "HF_TOKEN" not in env
    assert not any(value in repr(env) for value in DRIVER_SECRETS.values())


def test_processes_we_start_inherit_no_secret() -> None:
    uri = "http://alice:p@ss-w0rd-9e8d@mlflow:5000"
    env = process_env({**DRIVER_SECRETS, **RUNTIME, "MLFLOW_TRACKING_URI": uri, "SSH_AUTH_SOCK": "/tmp/agent"})
    assert not set(env) & set(DRIVER_SECRETS) and "SSH_AUTH_SOCK" not in env
    assert env["MLFLOW_TRACKING_URI"] == f"http://{REDACTED}@mlflow:5000"
    assert {k: v for k, v in env.items() if k != "MLFLOW_TRACKING_URI"} == RUNTIME  # by reference: AWS_PROFILE
    assert "ss-w0rd-9e8d" not in repr(env)


def test_a_local_ray_starts_with_the_scrubbed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in DRIVER_SECRETS.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    with process_env_only():
        assert not set(os.environ) & set(DRIVER_SECRETS) and os.environ.get("PATH") == before.get("PATH")
        os.environ["PYTHONBREAKPOINT"] = "ray.util.rpdb.set_trace"  # what ray.init itself sets
    assert os.environ.pop("PYTHONBREAKPOINT") == "ray.util.rpdb.set_trace"
    before.pop("PYTHONBREAKPOINT", None)
    assert dict(os.environ) == before, "the driver gets its own environment back"


def test_tune_copies_no_credentials_into_trial_runtime_envs(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.tune.execution import class_cache

    from ablate.sweep.resources import tune_env_filter

    for name, value in DRIVER_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SESSION_TOKEN", "aws-session-0e0f")
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    original = class_cache.ENV_VARS_TO_PROPAGATE
    leaked = class_cache._ActorClassCache().get(type("Leaky", (), {}))._default_options["runtime_env"]["env_vars"]
    assert leaked["AWS_SECRET_ACCESS_KEY"] == "aws-secret-3c2b1a", "Ray 2.60 copies AWS keys into trials (why)"
    with tune_env_filter():
        runtime_env = class_cache._ActorClassCache().get(type("Trial", (), {}))._default_options["runtime_env"]
    assert class_cache.ENV_VARS_TO_PROPAGATE is original
    assert runtime_env["env_vars"]["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.5"
    assert not any(name.startswith("AWS_") for name in runtime_env["env_vars"]), runtime_env


def test_an_arm_worker_gets_allowlisted_variables_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from trainers.run import _arm_env

    for name, value in DRIVER_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://alice:pa55@w0rd-1a2b@mlflow.internal:5000")
    env = _arm_env(tmp_path, ABLATE_TURN_FD="7")
    assert not set(env) & set(DRIVER_SECRETS) and env["ABLATE_TURN_FD"] == "7" and env["PYTHONPATH"]
    assert env["MLFLOW_TRACKING_URI"] == f"https://{REDACTED}@mlflow.internal:5000"
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path)) and env["PATH"] == os.environ["PATH"]


def test_free_text_redaction_covers_url_encoded_values() -> None:
    environ = {"ABLATE_DB_PWD": "p@ss/w0rd:x%y"}
    text = f"dsn={quote('p@ss/w0rd:x%y', safe='')} raw=p@ss/w0rd:x%y"
    assert "w0rd" not in redact_text(text, environ)


# The password of a URI may hold '@', ':', '/', '%' and any non-ASCII letter; it ends at whitespace or a quote.
_PASSWORD = st.text(st.sampled_from(list("@:/%?#=&+!$~-._aZ09") + ["é", "ß", "密", "\U0001f511"]), min_size=1,
                    max_size=24)
_USER = st.text(st.sampled_from(list("abcXYZ019-._~%")), min_size=0, max_size=10)
_HOST = st.from_regex(r"[a-z0-9]([a-z0-9\-]{0,10}[a-z0-9])?(\.[a-z0-9]{1,6}){0,2}", fullmatch=True)


@settings(max_examples=300, deadline=None)
@given(password=_PASSWORD, user=_USER, host=_HOST, port=st.none() | st.integers(1, 65535),
       scheme=st.sampled_from(["http", "https", "postgresql", "mysql+pymysql", "s3"]),
       tail=st.sampled_from(["", "/", "/mlflow", "/api/2.0?x=1", "#frag"]))
def test_uri_userinfo_ends_at_the_last_at_before_the_host(password: str, user: str, host: str,
                                                          port: int | None, scheme: str, tail: str) -> None:
    hostport = host + (f":{port}" if port is not None else "")
    uri = f"{scheme}://{user}:{password}@{hostport}{tail}"
    expected = f"{scheme}://{REDACTED}@{hostport}{tail}"
    assert redact_uri(uri) == expected
    assert redact_uri(f"failed: {uri} (retrying)") == f"failed: {expected} (retrying)"
    assert redact_uri(f"{{\"uri\": \"{uri}\", \"x\": \"a@b\"}}") == f"{{\"uri\": \"{expected}\", \"x\": \"a@b\"}}"
    encoded = f"{scheme}://{user}:{quote(password, safe='')}@{hostport}{tail}"
    assert redact_uri(encoded) == expected


def test_the_issue_uri() -> None:
    assert redact_uri("http://alice:p@ss-w0rd-123@mlflow:5000") == f"http://{REDACTED}@mlflow:5000"
    assert redact_uri("git+https://github.com/org/repo@v1.2") == "git+https://github.com/org/repo@v1.2"
    untouched = "s3://bucket/key@v1 and sqlite:////tmp/mlflow.db and http://host:5000/api"
    assert redact_uri(untouched) == untouched


def test_receipts_record_every_speed_setting_an_arm_inherits() -> None:
    # Each of these reaches the arm (process_env) and changes its speed: a receipt that left them out hid why
    # two nodes' blocks differ.
    speed = {"DNNL_DEFAULT_FPMATH_MODE": "BF16", "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_WAIT_POLICY": "PASSIVE",
             "GOMP_SPINCOUNT": "0", "MALLOC_ARENA_MAX": "2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "OPENBLAS_CORETYPE": "Haswell", "PYTHONMALLOC": "malloc",
             "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}
    assert process_env({**speed, **RUNTIME}).items() >= speed.items()
    env = capture_env({**speed, **RUNTIME, "LANG": "C.UTF-8"})
    assert env.items() >= speed.items()
    assert "PATH" not in env and "LANG" not in env and "HOME" not in env


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.sampled_from(sorted({*os.environ, "OMP_NUM_THREADS", "omp_num_threads", "AWS_PROFILE",
                                         "CUDA_VISIBLE_DEVICES", "MLFLOW_TRACKING_URI", "RAY_ADDRESS", "a*b", "[x]"})),
                 st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcxyz019*?[]!.-", max_size=24)))
def test_a_name_matches_a_pattern_list_exactly_as_fnmatch_matches_one_of_its_patterns(name: str) -> None:
    # _matches runs every pattern of a list as one regex; its reference twin is fnmatchcase pattern by pattern, on
    # the name and its upper case (how environment names are compared).
    import fnmatch

    from ablate import redact

    for patterns in (redact.ENV_ALLOWLIST, redact.CREDENTIAL_REFERENCES, redact.PROCESS_ENV_BASE + redact.ENV_ALLOWLIST,
                     ("A[!B]*", "*?_X", "[]]", "")):
        expected = any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name.upper(), p) for p in patterns)
        assert redact._matches(name, patterns) is expected, (name, patterns)
    assert redact._matches(name, ()) is False

"""Secrets never leave the process. Environment capture: an allowlist first, then redaction of secret names and credentials inside values."""

from __future__ import annotations

from ablate.redact import REDACTED, capture_env, redact_text, redact_uri

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

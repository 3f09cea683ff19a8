"""The run URI's storage, tried and its failures named: one small object written, read back and
deleted (:func:`probe`), and a storage exception turned into which part is wrong and one sentence
saying so (:func:`classify`: bucket, credentials, endpoint or storage).

Shared by the restore preflight on both sides — ``dtrun up``'s storage probe before anything is
rented (``orchestrator/run/preflight.py``) and the checkpoint round trip under torchrun
(``trainer/preflight.py``) — and by ``dtrun up``/``dtrun check``'s run-URI probe
(``orchestrator/run/uricheck.py``), so every one of them names a failure in the same words.

Standard library only: storage goes through ``orchestrator.contract.runuri`` (fsspec, lazily);
a botocore error is recognised by its ``response`` dict, without importing botocore.
"""

from __future__ import annotations

import os
import uuid

from orchestrator.contract import runuri

PREFLIGHT_DIR = "preflight"
"""``<run-uri>/preflight/``: the probe's object and the preflight's round-trip checkpoint."""


def classify(exc: BaseException, uri: str) -> tuple[str, str]:
    """(problem, message) for a storage exception: bucket, credentials, endpoint or storage."""
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    bucket = uri[len("s3://"):].split("/", 1)[0] if uri.startswith("s3://") else None
    code = ""
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        code = str(resp.get("Error", {}).get("Code", ""))
    if code == "NoSuchBucket" or "nosuchbucket" in low or "bucket does not exist" in low \
            or (bucket and isinstance(exc, FileNotFoundError)):
        return "bucket", (f"bucket {bucket!r} does not exist (checkpoint.uri {uri}): create it, or fix the "
                          "URI; checkpoints would fail on the node")
    creds = ("nocredentials", "unable to locate credentials", "invalidaccesskeyid", "signaturedoesnotmatch",
             "accessdenied", "access denied", "expiredtoken", "forbidden", "partialcredentials")
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "403") \
            or isinstance(exc, PermissionError) or any(c in low for c in creds):
        return "credentials", (f"storage credentials were refused for {uri} ({code or type(exc).__name__}): "
                               "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or the profile) and the bucket "
                               "policy (needs s3:PutObject, GetObject, DeleteObject, ListBucket)")
    if "endpointconnectionerror" in low or "could not connect" in low or "connection refused" in low \
            or "name or service not known" in low or isinstance(exc, ConnectionError):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the default"
        return "endpoint", f"cannot reach the storage endpoint ({endpoint}) for {uri}: {text.splitlines()[0][:200]}"
    return "storage", f"the run URI {uri} is not usable: {text.splitlines()[0][:300]}"


def probe(uri: str) -> tuple[str, str] | None:
    """Write, read back and delete one small object; (problem, message) or None when fine."""
    key = runuri.join(uri, PREFLIGHT_DIR, f"probe-{uuid.uuid4().hex[:8]}")
    try:
        runuri.write_text(key, "dtrun-preflight")
        if runuri.read_text(key) != "dtrun-preflight":
            return "storage", f"the run URI {uri} returned different bytes than were written"
        runuri.remove(key)
    except Exception as e:  # noqa: BLE001 - every storage error is classified and reported
        return classify(e, uri)
    return None

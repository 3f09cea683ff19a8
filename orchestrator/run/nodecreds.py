"""Object-store credentials for nodes that run somewhere else.

A rented node (RunPod/Lambda/Vast through SkyPilot, Modal) reads ``<run-uri>/job.yaml``, writes
its checkpoints to an ``s3://`` run URI and may read ``s3://`` training data: it needs this
machine's AWS credentials, or it exits 2 after provisioning was paid for.

:func:`node_storage` returns ``(env, secrets)`` for one launch:

* ``secrets`` (``LaunchRequest.secrets``: never logged or stored; the provider hands it to its
  SDK's secret mechanism): ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and, when set,
  ``AWS_SESSION_TOKEN`` — from the controller's environment, else from boto3's credential chain
  (``AWS_PROFILE``, ``~/.aws/credentials``, SSO, …), frozen at launch time. A session token
  expires: a node launched with temporary credentials loses the bucket when they do.
* ``env`` (not secret): ``AWS_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3``, ``AWS_DEFAULT_REGION``,
  ``AWS_REGION`` where set (the region from the AWS config file when the chain supplied the keys).

Nodes on this machine (``local``, ``fake``) get nothing here: they inherit the controller's
process environment. Nothing is needed when neither ``checkpoint.uri`` nor ``trainer.data`` is
``s3://``. No credentials anywhere → :class:`orchestrator.contract.errors.ProviderRefused` (exit 5)
naming what to set; the caller raises it before anything is rented. boto3 is imported only
when the environment has no keys (never on the dry-run path).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from orchestrator.contract.errors import ProviderRefused

ON_THIS_MACHINE = ("local", "fake")
ACCESS_KEY = "AWS_ACCESS_KEY_ID"
SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
SESSION_TOKEN = "AWS_SESSION_TOKEN"
AWS_SECRET_VARS = (ACCESS_KEY, SECRET_KEY, SESSION_TOKEN)
AWS_PLAIN_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION")
HOW = (f"set {ACCESS_KEY} and {SECRET_KEY} (and {SESSION_TOKEN} for temporary keys; "
       "AWS_ENDPOINT_URL for an S3-compatible store) in the environment of `dtrun up`, "
       "or configure a profile in ~/.aws/credentials (AWS_PROFILE selects it)")


def s3_uses(spec: Any) -> list[str]:
    """The spec fields that point the nodes at S3 (``checkpoint.uri``, ``trainer.data``)."""
    out = []
    if str(spec.run_uri).startswith("s3://"):
        out.append("checkpoint.uri")
    if spec.trainer is None:
        return out
    if str(spec.trainer.data).startswith("s3://"):
        out.append("trainer.data")
    if str(getattr(spec.trainer, "val_data", None) or "").startswith("s3://"):
        out.append("trainer.val_data")
    return out


def _from_chain() -> tuple[dict[str, str], str | None]:
    """Frozen credentials (and the configured region) from boto3's chain; ({}, None) if none."""
    try:
        import boto3
        from botocore.exceptions import BotoCoreError
    except ImportError:  # pragma: no cover - boto3 is a core dependency
        return {}, None
    try:
        session = boto3.Session()
        creds = session.get_credentials()
        frozen = creds.get_frozen_credentials() if creds is not None else None
        region = session.region_name
    except (BotoCoreError, OSError, ValueError):
        return {}, None
    if frozen is None or not frozen.access_key or not frozen.secret_key:
        return {}, None
    out = {ACCESS_KEY: frozen.access_key, SECRET_KEY: frozen.secret_key}
    if frozen.token:
        out[SESSION_TOKEN] = frozen.token
    return out, region


def node_storage(spec: Any, provider: str, environ: Mapping[str, str] | None = None
                 ) -> tuple[dict[str, str], dict[str, str]]:
    """``(env, secrets)`` a node on ``provider`` needs to reach the spec's ``s3://`` URIs.

    Raises ProviderRefused (exit 5) naming what to set when a remote node would need S3
    credentials and none are found."""
    if provider in ON_THIS_MACHINE:
        return {}, {}
    uses = s3_uses(spec)
    if not uses:
        return {}, {}
    environ = os.environ if environ is None else environ
    env = {k: environ[k] for k in AWS_PLAIN_VARS if environ.get(k)}
    secrets = {k: environ[k] for k in AWS_SECRET_VARS if environ.get(k)}
    if not (secrets.get(ACCESS_KEY) and secrets.get(SECRET_KEY)):
        secrets, region = _from_chain()
        if region and not (env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION")):
            env["AWS_DEFAULT_REGION"] = region
    if not secrets:
        val = {"checkpoint.uri": spec.run_uri, "trainer.data": getattr(spec.trainer, "data", None),
               "trainer.val_data": getattr(spec.trainer, "val_data", None)}
        where = " and ".join(f"{u} ({val[u]})" for u in uses)
        raise ProviderRefused(f"no AWS credentials for the {provider} nodes: {where} is on S3 and a rented "
                              f"node has no other way in; {HOW}; nothing rented")
    return env, secrets

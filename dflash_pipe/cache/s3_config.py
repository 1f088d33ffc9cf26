"""S3 settings, credentials and error classes for the filesystem seam (fs.py): the parts that know AWS.

Nothing here writes or logs a credential: `scrub` removes this environment's secret values (and signed
URL parameters) from any text before it becomes a message.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..errors import UsageError

log = logging.getLogger("dflash_pipe.cache.fs")

CRED_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
TRANSIENT = re.compile(r"(AWS Error (NETWORK_CONNECTION|SLOW_DOWN|SERVICE_UNAVAILABLE|THROTTLING|INTERNAL_FAILURE|"
                       r"REQUEST_TIMEOUT|UNKNOWN)|curlCode|HTTP status 5\d\d|response code 5\d\d|503|500|502|504|"
                       r"SlowDown|Throttl|[Cc]onnection (reset|refused|closed)|[Tt]imeout|Broken pipe)")
DENIED = re.compile(r"ACCESS_DENIED|AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|HTTP status 403|"
                    r"response code 403|ExpiredToken|InvalidToken|TokenRefreshRequired", re.I)
# S3-compatible servers that do not take the SDK's aws-chunked uploads with trailing checksums (rclone serve s3,
# older MinIO / Ceph RGW) answer an upload part with HTTP 411 MissingContentLength
CHUNKED_REFUSED = re.compile(r"MissingContentLength|HTTP status 411", re.I)
CHUNKED_HINT = ("this S3-compatible server refuses aws-chunked uploads: run with "
                "AWS_REQUEST_CHECKSUM_CALCULATION=when_required in the environment")


# a 400 Bad Request is never transient; on a GET that worked before it is most often an expired session token
# (S3 answers ExpiredToken with 400, and pyarrow's GET reports it as 'AWS Error UNKNOWN (HTTP status 400)' without
# the code, which TRANSIENT's UNKNOWN would otherwise retry)
BAD_REQUEST = re.compile(r"HTTP status 400\b|response code 400\b")


def credentials_refusal(what: str, message: str) -> UsageError | None:
    """The usage error for a store that refused the credentials (403, a bad key or signature) or the request
    (400, most often an expired token), else None. `message` must already be scrubbed."""
    if DENIED.search(message):
        return UsageError(f"{what}: access denied ({message})", CRED_HINT)
    if BAD_REQUEST.search(message):
        return UsageError(f"{what}: the store refused the request as bad (HTTP 400; an expired session token is the "
                          f"usual cause) ({message})", "renew the credentials; " + CRED_HINT)
    return None


def chunked_refusal(message: str) -> UsageError | None:
    """The usage error for a store that refused an aws-chunked upload (a setting, not a transient fault), else None."""
    return UsageError(message, CHUNKED_HINT) if CHUNKED_REFUSED.search(message) else None
CRED_HINT = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary keys), or "
             "AWS_PROFILE with ~/.aws/credentials, or run where an instance/container role applies; add "
             "?anonymous=true for a public bucket")


def scrub(text: str) -> str:
    """`text` with the values of credential variables of this environment replaced by '***'."""
    for var in CRED_ENV:
        val = os.environ.get(var, "")
        if len(val) >= 4:
            text = text.replace(val, "***")
    text = re.sub(r"(?i)(secret_key|access_key|session_token|X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|"
                  r"X-Goog-Signature|X-Goog-Credential|Signature|AWSAccessKeyId)=[^&\s]+", r"\1=***", text)
    return re.sub(r"(?i)(https?://)[^/@\s:]+:[^/@\s]+@", r"\1***:***@", text)   # user:password@ in an endpoint


def s3_client(query: dict, safe: str):
    """(pyarrow S3FileSystem, endpoint URL, region) from the URI query and the environment."""
    import pyarrow.fs as pafs

    endpoint = (query.get("endpoint") or query.get("endpoint_override") or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or "")
    scheme = query.get("scheme")
    if "://" in endpoint:
        ep = urlsplit(endpoint)
        scheme, endpoint = scheme or ep.scheme, ep.netloc
    region = query.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    anonymous = query.get("anonymous", "").lower() in ("1", "true", "yes")
    if not anonymous and credential_source() is None:
        raise UsageError(f"{safe}: no S3 credentials found", CRED_HINT)
    kw: dict[str, Any] = {"anonymous": anonymous,
                          "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3),
                          "connect_timeout": 5.0, "request_timeout": 60.0}
    if endpoint:
        kw["endpoint_override"] = endpoint
    if scheme:
        kw["scheme"] = scheme
    if region:
        kw["region"] = region
    elif endpoint:
        kw["region"] = "us-east-1"  # S3-compatible servers ignore it, but the signer needs one
    url = f"{scheme or 'https'}://{endpoint}" if endpoint else ""
    return pafs.S3FileSystem(**kw), url, kw.get("region", "")


def credential_source() -> str | None:
    """Where the standard chain would find credentials (names only), None if nowhere. Instance and
    container roles cannot be seen without asking the metadata service, so they count unless
    AWS_EC2_METADATA_DISABLED=true."""
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return "environment"
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE") and env.get("AWS_ROLE_ARN"):
        return "web identity"
    if env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return "container role"
    home = Path(os.path.expanduser("~"))
    files = [env.get("AWS_SHARED_CREDENTIALS_FILE", str(home / ".aws" / "credentials")),
             env.get("AWS_CONFIG_FILE", str(home / ".aws" / "config"))]
    if any(Path(f).is_file() for f in files):
        return "config files"
    if env.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true":
        return "instance role (not checked)"
    return None


def list_incomplete_uploads(bucket: str, prefix: str, endpoint_url: str, region: str) -> list[str] | None:
    """Keys with an unfinished multipart upload under the prefix (boto3, same endpoint); None = cannot tell."""
    import boto3

    kw: dict[str, Any] = {"region_name": region or os.environ.get("AWS_REGION") or "us-east-1"}
    if endpoint_url:
        kw["endpoint_url"] = endpoint_url
    try:
        client = boto3.client("s3", **kw)
        out: list[str] = []
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
            out += [f"s3://{bucket}/{u['Key']}" for u in page.get("Uploads", [])]
        return out
    except Exception as exc:  # noqa: BLE001 - verify reports it cannot tell, never fails on it
        log.warning("cannot list incomplete uploads of s3://%s/%s: %s", bucket, prefix, scrub(str(exc))[:200])
        return None

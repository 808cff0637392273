"""AWS: IMDSv2 (a session token, IMDSv1 when the PUT is unanswered), spot instance-action, rebalance
recommendations and scheduled maintenance, each polled on its own thread (docs/notices.md). The paths,
event codes, window and poll period are AWS's facts, in skyspot/clouds/aws.py; the protocol is here.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from datetime import datetime
from types import SimpleNamespace
from typing import Any, Callable, Mapping

from skyspot.clouds.aws import (
    AWS_INSTANCE_ACTION_PATH,
    AWS_INSTANCE_PATHS,
    AWS_MAINTENANCE_PATH,
    AWS_NOTICE_WINDOW_S,
    AWS_POLL_S,
    AWS_REBALANCE_PATH,
    AWS_SHUTDOWN_CODES,
    AWS_TOKEN_PATH,
    AWS_WARNING_CODES,
)
from skyspot.trainer.notice.watcher import (
    Binding,
    MetadataHttp,
    Notice,
    Watcher,
    _Path,
    _Stopped,
    _Unexpected,
    _http_date,
    _true,
)

log = logging.getLogger(__name__)

AWS_MAINTENANCE_POLL_S = 60.0  # ours: scheduled events come days ahead ("at least 14 days" for most)

AWS_TOKEN_TTL_S = 21600  # IMDSv2 maximum, 6 h: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html
AWS_TOKEN_REFRESH_S = 60.0  # ours: fetch a new token this long before the old one expires
AWS_TOKEN_TIMEOUT_S = 1.0  # botocore's DEFAULT_METADATA_SERVICE_TIMEOUT: an unanswered PUT means "use IMDSv1"
AWS_TOKEN_RETRY_S = 300.0  # ours: after falling back to IMDSv1, ask for a token again this often
AWS_TIMEOUT_S = 2.0  # ours: IMDS is on the host, it answers in milliseconds or not at all


# -- AWS: IMDS, three paths polled ----------------------------------------------------------------


class AwsSession:
    """IMDSv2 tokens shared by the AWS paths, falling back to IMDSv1 as botocore does.

    botocore (utils.IMDSFetcher._fetch_metadata_token) asks for a token with a 1 s timeout; if the
    PUT times out, cannot connect, or is answered 403, 404 or 405, it sends the GET without a token.
    That is what saves a container behind the default hop limit of 1, where the PUT's answer never
    arrives. AWS_EC2_METADATA_V1_DISABLED=true forbids the fallback. Here the fallback lasts until a
    tokenless GET is refused (401: the instance requires IMDSv2) or AWS_TOKEN_RETRY_S has passed.
    """

    def __init__(self, w: Watcher):
        self.w = w
        self.lock = threading.Lock()
        self.token: str | None = None
        self.expires = 0.0
        self.v1_until = 0.0
        self.v1_allowed = not _true(w._env, "AWS_EC2_METADATA_V1_DISABLED")

    def _headers(self) -> dict[str, str]:
        """Token headers for the next GET ({} in IMDSv1 mode). Fetches a token when needed."""
        with self.lock:
            now = time.monotonic()
            if self.token is not None and now < self.expires - AWS_TOKEN_REFRESH_S:
                return {"X-aws-ec2-metadata-token": self.token}
            if now < self.v1_until:
                return {}
            try:
                status, _, body = self.w._http.request(
                    "PUT",
                    AWS_TOKEN_PATH,
                    {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
                    AWS_TOKEN_TIMEOUT_S,
                )
            except _Stopped:
                raise
            except (OSError, http.client.HTTPException) as error:  # timed out, refused, reset: no answer
                return self._no_token(f"no answer ({error or type(error).__name__})")
            if status == 200 and body:
                self.token, self.expires = body.decode().strip(), now + AWS_TOKEN_TTL_S
                return {"X-aws-ec2-metadata-token": self.token}
            if status in (403, 404, 405):
                return self._no_token(f"answered {status}")
            raise _Unexpected(f"token PUT answered {status}")

    def _no_token(self, why: str) -> dict[str, str]:
        if not self.v1_allowed:
            raise _Unexpected(f"IMDSv2 token PUT: {why}, and AWS_EC2_METADATA_V1_DISABLED forbids IMDSv1")
        log.info("IMDSv2 token PUT: %s; asking without a token (IMDSv1), as botocore does", why)
        self.v1_until = time.monotonic() + AWS_TOKEN_RETRY_S
        return {}

    def get(self, path: str) -> tuple[int, bytes]:
        for _ in (1, 2):
            headers = self._headers()
            status, _, body = self.w._http.request("GET", path, headers, AWS_TIMEOUT_S)
            if status != 401:
                return status, body
            with self.lock:  # expired, from a previous instance, or IMDSv2 required: one fresh try
                if not headers:
                    self.v1_until = 0.0
                elif self.token == headers["X-aws-ec2-metadata-token"]:
                    self.token = None  # (another path may have replaced it already)
        raise _Unexpected("IMDS refused the request (401)")


def bind(w: Watcher) -> Binding:
    session = AwsSession(w)
    rebalances_seen: set[bytes] = set()

    def instance_action() -> None:
        status, body = session.get(AWS_INSTANCE_ACTION_PATH)
        if status == 200:
            w._deliver(_aws_notice(body, time.time()))
        elif status != 404:
            raise _Unexpected(f"instance-action answered {status}")

    def rebalance() -> None:
        status, body = session.get(AWS_REBALANCE_PATH)
        if status == 200 and body not in rebalances_seen:
            rebalances_seen.add(body)
            received = time.time()
            # No deadline comes with it; the soonest a reclaim can land is a full notice away.
            w._warn(
                f"rebalance:{body!r}", Notice("aws", received + AWS_NOTICE_WINDOW_S, "rebalance", received, "warning")
            )
        elif status not in (200, 404):
            raise _Unexpected(f"rebalance answered {status}")

    def maintenance() -> None:
        status, body = session.get(AWS_MAINTENANCE_PATH)
        if status == 404:
            events = []
        elif status == 200:
            events = json.loads(body or b"[]")
            if not isinstance(events, list):
                raise _Unexpected("scheduled events are not a list")
        else:
            raise _Unexpected(f"scheduled events answered {status}")
        received, active = time.time(), set()
        for event in events:
            if not isinstance(event, dict) or str(event.get("State", "active")).lower() != "active":
                continue
            code, event_id = str(event.get("Code", "")).lower(), str(event.get("EventId", ""))
            key = f"aws:{event_id or code}"
            deadline = _http_date(event.get("NotBefore")) or received + AWS_NOTICE_WINDOW_S
            if code in AWS_SHUTDOWN_CODES:
                active.add(key)
                w._plan(key, Notice("aws", deadline, code, received, "shutdown", event_id or None))
            elif code in AWS_WARNING_CODES:
                w._warn(key, Notice("aws", deadline, code, received, "warning", event_id or None))
        for key in w._planned_keys("aws:") - active:
            w._cancel(key)

    paths = [_Path(w, "aws-instance-action", w._period(AWS_POLL_S), instance_action)]
    if w._on_warning is not None:
        paths.append(_Path(w, "aws-rebalance", w._period(AWS_POLL_S), rebalance))
    paths.append(_Path(w, "aws-maintenance", w._period(AWS_MAINTENANCE_POLL_S), maintenance))
    return Binding(paths)


def _aws_notice(body: bytes, received: float) -> Notice:
    """Parse {"action": "terminate", "time": "2026-11-29T08:22:00Z"}. A 200 means a notice even if the body is odd."""
    action, deadline = "terminate", received + AWS_NOTICE_WINDOW_S
    try:
        doc = json.loads(body)
        action = str(doc.get("action") or action)
        deadline = datetime.fromisoformat(doc["time"].replace("Z", "+00:00")).timestamp()
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("unreadable AWS instance-action %r; assuming a two-minute warning", body[:200])
    return Notice("aws", deadline, action, received)


# -- what the node is (trainer/instance.py) ---------------------------------------------------------


def read_instance(http: MetadataHttp, environ: Mapping[str, str], left: Callable[[], float]) -> dict[str, Any]:
    """Instance type, lifecycle (spot | on-demand | scheduled), zone, zone ID, region, AMI, through the
    notice watcher's IMDSv2 session (token, IMDSv1 fallback as botocore does), used once. `left()` raises
    once the reading's budget is spent."""
    session = AwsSession(SimpleNamespace(_http=http, _env=environ))
    values: dict[str, str] = {}
    for key, path in AWS_INSTANCE_PATHS.items():
        left()
        status, body = session.get(path)
        if status == 200:
            values[key] = body.decode().strip()
        elif key in ("instance_type", "lifecycle"):
            raise ValueError(f"{path} answered {status}")
    lifecycle = values.get("lifecycle", "")
    return {
        "instance_type": values.get("instance_type"),
        "capacity": lifecycle,
        "spot": lifecycle == "spot",
        "zone": values.get("zone"),
        "zone_id": values.get("zone_id"),
        "region": values.get("region"),
        "image": values.get("image"),
    }

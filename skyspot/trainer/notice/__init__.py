"""Shutdown-warning watchers: learn from the cloud's metadata service that this VM is about to go.

One concept, one package per cloud as SkyPilot keeps its clouds: three metadata protocols (aws.py:
IMDSv2 tokens; gcp.py: hanging GETs; azure.py: Scheduled Events and their approval) all answer the one
question "when does this VM go?", and share the thread, backoff and delivery machinery of watcher.py;
the clouds' published windows and poll periods themselves live in skyspot/clouds.py.

A VM is told before it is taken away, through endpoints only the VM itself can reach:

    AWS    GET /latest/meta-data/spot/instance-action            spot interruption, 2 min ahead
           GET /latest/meta-data/events/recommendations/rebalance  elevated risk (no shutdown yet)
           GET /latest/meta-data/events/maintenance/scheduled    reboots, stops, retirements, days ahead
    GCP    GET /computeMetadata/v1/instance/preempted            hanging GET: TRUE on preemption (30 s)
           GET /computeMetadata/v1/instance/maintenance-event     hanging GET: TERMINATE_ON_HOST_MAINTENANCE
                                                                  an hour ahead on GPU VMs
    Azure  GET /metadata/scheduledevents                         Preempt (30 s), Reboot, Redeploy,
                                                                  Terminate, Freeze (10-15 min), for
                                                                  the VMs named in Resources

One watcher per node, started by the node's supervisor (supervise.py) before torchrun, so before
the trainer's setup and model load; a trainer started without the supervisor starts its own on the
node leader. Each warning is one of:

    preemption   the VM goes at `deadline` (AWS instance-action, GCP preempted, Azure Preempt):
                 on_notice, once; the trainer saves an emergency checkpoint and exits for recovery.
    shutdown     planned: the VM stops or restarts at `deadline`, minutes to days away (maintenance):
                 on_warning at once (the trainer checkpoints early and keeps training), then
                 on_notice `lead` seconds before the deadline, as for a preemption.
    warning      no shutdown expected (AWS rebalance, Azure Freeze, GCP live migration): on_warning.

    watcher = start_notice_watcher(on_notice=..., on_warning=...)
    ...
    if watcher:
        watcher.stop()          # on Azure, also approves the events acted on (StartRequests)

Which cloud comes from SKYPILOT_CLUSTER_INFO, the JSON SkyPilot sets on every node, e.g.
{"cluster_name": "c1", "cloud": "AWS", "region": "us-east-1", "zone": "us-east-1a"}. Without a known
cloud the watcher does nothing at all: no thread, no socket. Each cloud's endpoint can be redirected
(the local executor and tests serve them on 127.0.0.1, see skyspot.executors.local.metadata_server), with the
variables the clouds' own SDKs read:

    AWS_EC2_METADATA_SERVICE_ENDPOINT        e.g. http://127.0.0.1:8123/   (botocore's; also
    AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE   IPv6 -> http://[fd00:ec2::254], AWS_EC2_METADATA_V1_DISABLED)
    GCE_METADATA_HOST (or GCE_METADATA_ROOT) e.g. 127.0.0.1:8123            (google-auth's; GCE_METADATA_IP
                                                                           is the fallback when DNS fails)
    SKYSPOT_AZURE_METADATA_ENDPOINT          e.g. http://127.0.0.1:8123     (ours; Azure's SDKs have none)

Every path is watched on its own thread with its own schedule and backoff, so one failing endpoint
never delays another. Requests go through http.client rather than urllib, because urllib honours
HTTP_PROXY and a metadata request must never leave the machine. See docs/notices.md for payloads,
timings and sources.
"""

from __future__ import annotations

# The names a caller of the one module `skyspot.trainer.notice` used, all still here (trainer/instance.py
# reads IMDS through _AwsSession and _Http); tests that tune a cloud's timing patch its own module.
from skyspot.trainer.notice.watcher import (AWS_IPV6_ENDPOINT, DEFAULT_ENDPOINTS, ENDPOINT_VARS, GCP_DEFAULT_IP,
                                            KINDS, MAX_BACKOFF_S, POLL_ENV, SHORT_TIMEOUT_S, Notice, Watcher, _Http,
                                            cloud_from_env, fallback_target, poll_from_env, start_notice_watcher,
                                            watch_for, watch_target)
from skyspot.trainer.notice.aws import (AWS_INSTANCE_ACTION_PATH, AWS_MAINTENANCE_PATH, AWS_MAINTENANCE_POLL_S,
                                        AWS_REBALANCE_PATH, AWS_SHUTDOWN_CODES, AWS_TIMEOUT_S, AWS_TOKEN_PATH,
                                        AWS_TOKEN_REFRESH_S, AWS_TOKEN_RETRY_S, AWS_TOKEN_TIMEOUT_S, AWS_TOKEN_TTL_S,
                                        AWS_WARNING_CODES, _AwsSession)
from skyspot.trainer.notice.gcp import (GCP_MAINTENANCE_PATH, GCP_PREEMPTED_PATH, GCP_RETRY_S, GCP_SHUTDOWN_EVENTS,
                                        GCP_UPCOMING_PATH, GCP_WAIT_TIMEOUT_S, GCP_WARNING_EVENTS)
from skyspot.trainer.notice.azure import (AZURE_ACK_TIMEOUT_S, AZURE_API_VERSION, AZURE_EVENTS_PATH,
                                          AZURE_FIRST_TIMEOUT_S, AZURE_INSTANCE_API_VERSION, AZURE_NAME_PATH,
                                          AZURE_SHUTDOWN_TYPES, AZURE_TIMEOUT_S, AZURE_WARNING_TYPES)

__all__ = ["AWS_IPV6_ENDPOINT", "DEFAULT_ENDPOINTS", "ENDPOINT_VARS", "GCP_DEFAULT_IP", "KINDS", "MAX_BACKOFF_S",
           "POLL_ENV", "SHORT_TIMEOUT_S", "Notice", "Watcher", "_Http", "cloud_from_env", "fallback_target",
           "poll_from_env", "start_notice_watcher", "watch_for", "watch_target", "AWS_INSTANCE_ACTION_PATH",
           "AWS_MAINTENANCE_PATH", "AWS_MAINTENANCE_POLL_S", "AWS_REBALANCE_PATH", "AWS_SHUTDOWN_CODES",
           "AWS_TIMEOUT_S", "AWS_TOKEN_PATH", "AWS_TOKEN_REFRESH_S", "AWS_TOKEN_RETRY_S", "AWS_TOKEN_TIMEOUT_S",
           "AWS_TOKEN_TTL_S", "AWS_WARNING_CODES", "_AwsSession", "GCP_MAINTENANCE_PATH", "GCP_PREEMPTED_PATH",
           "GCP_RETRY_S", "GCP_SHUTDOWN_EVENTS", "GCP_UPCOMING_PATH", "GCP_WAIT_TIMEOUT_S", "GCP_WARNING_EVENTS",
           "AZURE_ACK_TIMEOUT_S", "AZURE_API_VERSION", "AZURE_EVENTS_PATH", "AZURE_FIRST_TIMEOUT_S",
           "AZURE_INSTANCE_API_VERSION", "AZURE_NAME_PATH", "AZURE_SHUTDOWN_TYPES", "AZURE_TIMEOUT_S",
           "AZURE_WARNING_TYPES"]

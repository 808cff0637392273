"""Shutdown-warning watchers: learn from the cloud's metadata service that this VM is about to go.

One concept, one package per cloud as SkyPilot keeps its clouds: three metadata protocols (aws.py:
IMDSv2 tokens; gcp.py: hanging GETs; azure.py: Scheduled Events and their approval) all answer the one
question "when does this VM go?", and share the thread, backoff and delivery machinery of watcher.py;
the clouds' published windows, poll periods, endpoints and paths themselves live in skyspot/clouds/
(one class per cloud, which also names its protocol module here: `notice_watcher`).

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

# What callers outside the package use; a cloud's own protocol (aws.py, gcp.py, azure.py) is imported by
# the watcher through the module its class in skyspot/clouds/ names, and tests that tune a protocol's
# timing patch that module.
from skyspot.trainer.notice.watcher import (
    Notice,
    Watcher,
    fallback_target,
    start_notice_watcher,
    watch_for,
    watch_target,
)

__all__ = ["Notice", "Watcher", "fallback_target", "start_notice_watcher", "watch_for", "watch_target"]

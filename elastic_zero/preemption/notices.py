"""What the clouds' metadata servers say, read into "this node leaves by time T". Pure: the
response (status, body) and the clock are arguments; nothing here does I/O.

Each reader returns (notice or None, problem or None). A response that cannot be read is a
problem, said once by the watcher, and read the safe way for its source: an AWS instance action
or an Azure Preempt event that exists but cannot be read is a notice for now (the node goes, we
only do not know when); a GCP value that is neither TRUE nor FALSE is no notice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime

MAX_BODY = 64 * 1024  # a metadata answer is a few hundred bytes; more is read as unreadable
# what reading a hostile answer may raise (RecursionError: JSON nested deep within 64 KiB)
UNREADABLE = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError)
GCP_NOTICE_S = 30.0  # GCP stops a preempted VM 30 s after it says so


@dataclass(frozen=True)
class Notice:
    source: str  # "sigterm" | "aws" | "aws-rebalance" | "gcp" | "azure" | "ray-drain"
    deadline_at: float | None  # when the node goes (epoch seconds); None: unknown, soon
    detail: str
    ack: tuple[str, ...] = ()  # what to acknowledge once the hand-off is done (Azure's event ids)


def _body_text(body: bytes) -> tuple[str | None, str | None]:
    if len(body) > MAX_BODY:
        return None, f"a response of over {MAX_BODY // 1024} KiB"
    try:
        return body.decode("utf-8"), None
    except UnicodeDecodeError:
        return None, "a response that is not UTF-8 text"


def _deadline(when: datetime, now: float) -> float:
    """A deadline in the past means now: the node may go any moment."""
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(when.timestamp(), now)


def aws_instance_action(status: int, body: bytes, now: float) -> tuple[Notice | None, str | None]:
    """/latest/meta-data/spot/instance-action: 404 until AWS schedules an action, then
    {"action": "terminate" | "stop" | "hibernate", "time": "2026-11-25T08:22:00Z"} (two minutes on)."""
    if status == 404:
        return None, None
    if status != 200:
        return None, f"AWS instance-action answered HTTP {status}"
    text, problem = _body_text(body)
    try:
        record = json.loads(text) if text is not None else None
        action, when = record["action"], datetime.strptime(record["time"], "%Y-%m-%dT%H:%M:%SZ")
    except UNREADABLE as exc:
        problem = problem or f"an unreadable AWS instance-action ({type(exc).__name__}: {str(exc)[:80]})"
        return Notice("aws", now, "spot instance action of unknown time"), problem
    return Notice("aws", _deadline(when, now), f"spot instance action {action!r} at {record['time']}"), None


def aws_rebalance(status: int, body: bytes, now: float) -> tuple[Notice | None, str | None]:
    """/latest/meta-data/events/recommendations/rebalance: 404, or {"noticeTime": ...} when the
    instance is at elevated risk of interruption. No deadline: the workers leave at a safe point."""
    if status == 404:
        return None, None
    if status != 200:
        return None, f"AWS rebalance recommendation answered HTTP {status}"
    text, problem = _body_text(body)
    try:
        record = json.loads(text) if text is not None else None
        when = str(record["noticeTime"])[:40]
    except UNREADABLE as exc:
        problem = problem or f"an unreadable AWS rebalance recommendation ({type(exc).__name__})"
        when = "an unknown time"
    return Notice("aws-rebalance", None, f"rebalance recommendation of {when}"), problem


def gcp_preempted(status: int, body: bytes, now: float) -> tuple[Notice | None, str | None]:
    """/computeMetadata/v1/instance/preempted: "FALSE", then "TRUE" once the VM is preempted
    (it stops GCP_NOTICE_S later)."""
    if status != 200:
        return None, f"GCP preempted answered HTTP {status}"
    text, problem = _body_text(body)
    value = (text or "").strip().upper()
    if value == "TRUE":
        return Notice("gcp", now + GCP_NOTICE_S, "the VM is preempted"), None
    if value == "FALSE":
        return None, None
    return None, problem or f"a GCP preempted value of {value[:40]!r} (neither TRUE nor FALSE)"


def azure_scheduled_events(status: int, body: bytes, now: float, vm_name: str | None = None,
                           ) -> tuple[Notice | None, str | None]:
    """/metadata/scheduledevents: {"DocumentIncarnation": n, "Events": [{"EventId", "EventType",
    "Resources": [vm names], "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT", ...}]}. A Preempt event
    for this VM (or any VM, when its name is unknown) is a notice; its ids are acknowledged later
    (StartRequests) so that Azure need not wait out NotBefore."""
    if status != 200:
        return None, f"Azure scheduled events answered HTTP {status}"
    text, problem = _body_text(body)
    try:
        events = json.loads(text)["Events"] if text is not None else None
        if not isinstance(events, list):
            raise TypeError("Events is not a list")
    except UNREADABLE as exc:
        return None, problem or f"unreadable Azure scheduled events ({type(exc).__name__}: {str(exc)[:80]})"
    ours = [e for e in events if isinstance(e, dict) and e.get("EventType") == "Preempt"
            and (vm_name is None or (isinstance(e.get("Resources"), list) and vm_name in e["Resources"]))]
    if not ours:
        return None, None
    deadlines, problems = [], []
    for event in ours:
        try:
            deadlines.append(_deadline(parsedate_to_datetime(event["NotBefore"]), now))
        except UNREADABLE:
            deadlines.append(now)  # no readable time (empty once the event has started): now
            problems.append(f"an Azure Preempt event with NotBefore {str(event.get('NotBefore'))[:40]!r}")
    ids = tuple(str(e["EventId"])[:100] for e in ours if isinstance(e.get("EventId"), str) and e["EventId"])
    return (Notice("azure", min(deadlines), f"Preempt event {', '.join(ids) or '(no id)'}", ack=ids),
            problems[0] if problems else None)

"""The cloud watchers against fake metadata servers on loopback (real HTTP): AWS IMDSv2 (token
first), GCP's long poll, Azure's Scheduled Events and their acknowledgement; which cloud is found;
and the bad answers (not JSON, a wrong time, a huge body, a deadline in the past, a server that
never answers): said once, read the safe way, never a crash or a hang. The oracle for each: the
notice the cloud's documentation says its answer means."""

from __future__ import annotations

import threading
import time

import pytest

from elastic_zero.preemption.cloud_watcher import CloudWatcher
from elastic_zero.preemption.notices import (
    GCP_NOTICE_S, MAX_BODY, aws_instance_action, aws_rebalance, azure_scheduled_events, gcp_preempted,
)
from fake_metadata import FakeMetadata

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


# ---- the readers (pure) ---------------------------------------------------------------------------

def test_aws_instance_action_is_a_notice_with_its_time():
    notice, problem = aws_instance_action(200, b'{"action": "terminate", "time": "2027-01-15T08:02:00Z"}', NOW)
    assert notice.source == "aws" and notice.deadline_at == NOW + 120 and problem is None
    assert aws_instance_action(404, b"", NOW) == (None, None)


@pytest.mark.parametrize("body, said", [
    (b"not json", "unreadable AWS instance-action"),
    (b'{"action": "terminate", "time": "tomorrow"}', "unreadable AWS instance-action"),
    (b"x" * (MAX_BODY + 1), "over 64 KiB"),
])
def test_an_unreadable_aws_instance_action_is_a_notice_for_now(body, said):
    notice, problem = aws_instance_action(200, body, NOW)
    assert notice.deadline_at == NOW and said in problem


def test_past_deadlines_mean_now():
    notice, _ = aws_instance_action(200, b'{"action": "stop", "time": "2020-01-01T00:00:00Z"}', NOW)
    assert notice.deadline_at == NOW


def test_aws_rebalance_is_a_notice_without_deadline():
    notice, _ = aws_rebalance(200, b'{"noticeTime": "2027-01-15T07:59:00Z"}', NOW)
    assert notice.source == "aws-rebalance" and notice.deadline_at is None


def test_gcp_preempted():
    assert gcp_preempted(200, b"TRUE", NOW)[0].deadline_at == NOW + GCP_NOTICE_S
    assert gcp_preempted(200, b"FALSE", NOW) == (None, None)
    notice, problem = gcp_preempted(200, b"<html>captive portal</html>", NOW)
    assert notice is None and "neither TRUE nor FALSE" in problem


def _azure(events) -> bytes:
    import json

    return json.dumps({"DocumentIncarnation": 3, "Events": events}).encode()


def test_azure_preempt_events_for_this_vm():
    ours = {"EventId": "e1", "EventType": "Preempt", "Resources": ["vm-1"], "NotBefore": "Fri, 15 Jan 2027 08:00:30 GMT"}
    other = {"EventId": "e2", "EventType": "Preempt", "Resources": ["vm-9"], "NotBefore": ""}
    reboot = {"EventId": "e3", "EventType": "Reboot", "Resources": ["vm-1"], "NotBefore": ""}
    notice, problem = azure_scheduled_events(200, _azure([ours, other, reboot]), NOW, vm_name="vm-1")
    assert notice.deadline_at == NOW + 30 and notice.ack == ("e1",) and problem is None
    assert azure_scheduled_events(200, _azure([other, reboot]), NOW, vm_name="vm-1") == (None, None)
    started = {**ours, "NotBefore": ""}  # empty once the event has started: now
    notice, problem = azure_scheduled_events(200, _azure([started]), NOW, vm_name="vm-1")
    assert notice.deadline_at == NOW and "NotBefore" in problem
    notice, problem = azure_scheduled_events(200, b"{{", NOW)
    assert notice is None and "unreadable Azure" in problem


# ---- the watcher over real HTTP --------------------------------------------------------------------

class Watching:
    """A CloudWatcher on its thread, with what it told and said."""

    def __init__(self, fake: FakeMetadata | None, clouds: list[str], url: str | None = None, **kw) -> None:
        url = url or fake.url
        self.fake = fake
        self.told, self.said = [], []
        self.told_event = threading.Event()
        self.watcher = CloudWatcher(clouds, {"aws": url, "gcp": url, "azure": url}, kw.pop("poll_s", 0.05),
                                    self._tell, self._log, **kw)
        self.thread = threading.Thread(target=self.watcher.run, daemon=True)
        self.thread.start()

    def _log(self, message: str, problem: bool) -> None:
        self.said.append(message if problem else f"(fine) {message}")

    def _tell(self, notice) -> None:
        self.told.append(notice)
        self.told_event.set()

    def wait_told(self, timeout_s: float = 10.0):
        assert self.told_event.wait(timeout_s), f"no notice; said {self.said}"
        return self.told[0]

    def wait_said(self, word: str, timeout_s: float = 10.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.said:
                if word in line:
                    return line
            time.sleep(0.02)
        raise AssertionError(f"never said {word!r}: {self.said}")

    def stop(self) -> None:
        self.watcher.stop()
        if self.fake is not None:
            self.fake.change()  # wakes a GCP long poll
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "the watcher did not stop"


@pytest.fixture
def fakes():
    made = []

    def make(cloud: str) -> FakeMetadata:
        made.append(FakeMetadata(cloud))
        return made[-1]

    yield make
    for fake in made:
        fake.close()


def test_aws_token_first_then_the_instance_action_once(fakes):
    fake = fakes("aws")
    w = Watching(fake, ["gcp", "azure", "aws"])
    deadline = time.time() + 120
    fake.change(notice={"action": "terminate", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline))})
    notice = w.wait_told()
    assert w.watcher.cloud == "aws" and notice.source == "aws" and abs(notice.deadline_at - deadline) <= 1
    time.sleep(0.3)  # several more polls: told once
    w.stop()
    assert len(w.told) == 1 and w.said == []
    aws = [r for r in fake.requests if r[1].startswith("/latest/")]
    assert aws[0][0] == "PUT"  # IMDSv2: the token before anything else (found out which cloud by it)
    gets = [r for r in aws if r[0] == "GET"]
    assert fake.tokens == ["token-1"] and all(r[2].get("x-aws-ec2-metadata-token") == "token-1" for r in gets)


def test_gcp_long_poll_answers_when_the_value_changes(fakes):
    fake = fakes("gcp")
    w = Watching(fake, ["aws", "gcp"], poll_s=1.0)
    while not any("wait_for_change=true" in r[1] for r in fake.requests):
        time.sleep(0.02)
    fake.change(notice=True)
    started = time.time()
    notice = w.wait_told()
    assert w.watcher.cloud == "gcp" and time.time() - started < 2
    assert abs(notice.deadline_at - (started + GCP_NOTICE_S)) < 2
    w.stop()


def test_gcp_already_preempted_when_the_watch_starts_is_told_at_once(fakes):
    """A watcher that starts (or takes over) after the value turned TRUE reads it at once, not at
    the end of a long poll that waits for a change (GCP's whole notice is 30 s)."""
    fake = fakes("gcp")
    fake.change(notice=True)
    started = time.time()
    w = Watching(fake, ["gcp"], poll_s=1.0)
    w.wait_told(timeout_s=5)
    assert time.time() - started < 3
    w.stop()


def test_azure_notice_and_acknowledgement(fakes):
    fake = fakes("azure")
    w = Watching(fake, ["azure"])
    fake.change(notice=[{"EventId": "ev-7", "EventType": "Preempt", "Resources": ["vm-1"],
                         "NotBefore": time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))}])
    notice = w.wait_told()
    assert notice.ack == ("ev-7",)
    assert w.watcher.acknowledge(notice.ack) is True
    assert fake.acks == [{"StartRequests": [{"EventId": "ev-7"}]}]
    w.stop()


def test_no_cloud_answers(fakes):
    fake = fakes("aws")
    closed = fake.url
    fake.close()  # nothing listens there now
    w = Watching(None, ["aws", "gcp", "azure"], url=closed)
    w.thread.join(timeout=10)
    assert not w.thread.is_alive() and w.watcher.cloud is None
    assert w.said == ["(fine) no metadata server of aws, gcp, azure answered: no cloud notices on this node"]


@pytest.mark.parametrize("answer, word, notice", [
    (b"x" * (10 * MAX_BODY), "over 64 KiB", True),
    (b"not json at all", "unreadable AWS instance-action", True),
])
def test_bad_aws_answers_are_said_once_and_read_as_a_notice_now(fakes, answer, word, notice):
    fake = fakes("aws")
    w = Watching(fake, ["aws"])
    while not any("instance-action" in r[1] for r in fake.requests):  # polling
        time.sleep(0.02)
    fake.change(answer=answer)
    told = w.wait_told()
    assert told.deadline_at <= time.time() + 1
    time.sleep(0.3)
    w.stop()
    assert sum(word in line for line in w.said) == 1, w.said


def test_a_server_that_never_answers_is_said_once_and_does_not_hang_the_watcher(fakes):
    fake = fakes("azure")
    w = Watching(fake, ["azure"], timeout_s=0.3)
    while not any("scheduledevents" in r[1] for r in fake.requests):
        time.sleep(0.02)
    fake.change(hang_s=1.0)
    w.wait_said("did not answer")
    fake.change(hang_s=0.0, notice=[{"EventId": "e", "EventType": "Preempt", "Resources": ["vm-1"], "NotBefore": ""}])
    w.wait_told()  # it went on polling
    w.stop()
    assert sum("did not answer" in line for line in w.said) == 1, w.said

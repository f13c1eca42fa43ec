"""Reliability: the step guard (non-finite losses, stop requests, agreed by every rank), the
supervisor (exceptions to one line and an exit code, dead ranks named), the OOM report,
and fault injection for tests and drills."""

from harness.reliability.guard import StepGuard
from harness.reliability.signals import entering, signal_received, steps_begin, steps_discarded, stop_requests
from harness.reliability.supervisor import PeerMonitor, Supervisor, collective_timeout_s

__all__ = [
    "PeerMonitor",
    "StepGuard",
    "Supervisor",
    "collective_timeout_s",
    "entering",
    "signal_received",
    "steps_begin",
    "steps_discarded",
    "stop_requests",
]

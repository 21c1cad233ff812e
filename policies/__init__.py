"""Scheduling vocabulary and policies shared by the simulator and the real engine."""

from policies.core import BE, LS, Batch, Granularity, Phase, Request, Sequence, Stage
from policies.scheduler import CapacityError, Policy, Scheduler

__all__ = [
    "BE",
    "LS",
    "Batch",
    "CapacityError",
    "Granularity",
    "Phase",
    "Policy",
    "Request",
    "Scheduler",
    "Sequence",
    "Stage",
]

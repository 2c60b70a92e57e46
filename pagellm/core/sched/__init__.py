"""Scheduling: the Scheduler, its waiting queues and the scheduler -> runner contract.

Pure Python (no torch): decides what runs each step; the model runner executes it.
"""

from pagellm.core.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from pagellm.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    RequestQueue,
    create_request_queue,
)
from pagellm.core.sched.scheduler import Scheduler

__all__ = [
    "CachedRequestData",
    "FCFSRequestQueue",
    "NewRequestData",
    "PriorityRequestQueue",
    "RequestQueue",
    "Scheduler",
    "SchedulerOutput",
    "create_request_queue",
]

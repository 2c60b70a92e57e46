"""Scheduling: the Scheduler and its waiting queues.

Decides what runs each step; the model runner executes it. The contract between them,
SchedulerOutput, lives in pagellm/scheduler_output.py (neither core nor worker owns it).
"""

from pagellm.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    RequestQueue,
    create_request_queue,
)
from pagellm.core.sched.scheduler import Scheduler

__all__ = [
    "FCFSRequestQueue",
    "PriorityRequestQueue",
    "RequestQueue",
    "Scheduler",
    "create_request_queue",
]

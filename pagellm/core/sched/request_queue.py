"""Waiting queues of the scheduler: FCFS (a deque) and priority (a heap).

In: requests to queue, peek, pop, put back or remove. Out: the next request to admit.
Knows nothing of KV blocks or token budgets.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from pagellm.core.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queues a request by the policy's order."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Puts a request back ahead of the others (preemption). The priority queue
        orders by (priority, arrival) anyway, so for it this is add_request."""

    @abstractmethod
    def peek_request(self) -> Request:
        """The next request to admit; IndexError when empty."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Removes and returns the next request; IndexError when empty."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Removes the given requests (absent ones are ignored)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """All queued requests, in no guaranteed order."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        if gone:
            self._queue = deque(r for r in self._queue if id(r) not in gone)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Min-heap on Request.__lt__: (priority, arrival_time, request_id)."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0]

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        # Aborts are rare: an O(n) rebuild beats lazy-deletion bookkeeping.
        gone = {id(r) for r in requests}
        if gone:
            self._heap = [r for r in self._heap if id(r) not in gone]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._heap)


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; expected 'fcfs' or 'priority'")

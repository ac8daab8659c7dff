"""What the broker's owners share: the state store's one thread and the broker's own tasks.

Blocking store calls run on one worker thread, in order (`broker.state.group_commit`: the
calls queued together commit together). Each owner (`broker.nodes`, `broker.uploads`, ...)
writes the store through `Core.db` for the rows it owns; nobody calls the store otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from broker.errors import StateUnavailable
from broker.ops.metrics import BrokerMetrics
from broker.state import GroupCommitter, StateStore, StorageError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Core:
    """The store (`store`, `db`) and the task set every owner runs its background work in."""

    def __init__(self, store: StateStore, metrics: BrokerMetrics) -> None:
        self.store = store
        """The state store: called only through `db` / `db_queued`, from the owners."""
        self._executor = GroupCommitter(store, metrics.observe_state_commit)
        self._tasks: set[asyncio.Task[Any]] = set()

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn` on the state thread, durable when it returns (the calls queued together
        commit together). A StorageError (the store's transaction undone) is
        StateUnavailable to the caller, its detail (which names the database) logged here."""
        return await self.durable(self.db_queued(fn, *args, **kwargs))

    def db_queued(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """`fn` queued on the state thread now, behind every call queued before it (so a
        decision queues its write under the placement lock and awaits it after releasing
        the lock, and the next decision's writes still land after it); await it with
        `durable`."""
        return asyncio.wrap_future(self._executor.submit(fn, *args, **kwargs))

    async def durable(self, queued: asyncio.Future[T]) -> T:
        """The outcome of a `db_queued` call, as `db` gives it."""
        try:
            return await queued
        except StorageError as err:
            logger.warning("the state store failed: %s", err)
            unavailable = "the broker cannot reach its state store; retry shortly"
            raise StateUnavailable(unavailable) from err

    def background(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Run `coro` as the broker's own task (cancelled by `close`); a failure is logged."""
        task = self.own(coro, name)
        task.add_done_callback(_log_failure)
        return task

    def own(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Run `coro` as the broker's own task (cancelled by `close`), its outcome left to
        whoever awaits it."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_tasks(self) -> None:
        """Cancel the broker's own tasks and wait for them to end."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def close(self) -> None:
        """Stop the state thread (after `cancel_tasks`)."""
        self._executor.shutdown()


def retrieve(task: asyncio.Task[Any]) -> None:
    """Mark the outcome of a task whose caller may have gone away as seen: its caller, if
    still there, gets it; nobody else must log it."""
    if not task.cancelled():
        task.exception()


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("%s failed: %s", task.get_name(), task.exception())

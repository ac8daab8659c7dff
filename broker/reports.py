"""Adaptive offload reports: the summaries devices send of what they ran locally and what they
offloaded, kept per session of a deployment."""

from __future__ import annotations

import logging
import time

from broker.core import Core
from broker.errors import NotFound
from broker.state import OffloadReportRecord, OffloadSummary
from broker.values import VISIBLE

logger = logging.getLogger(__name__)


OFFLOAD_SESSIONS_KEPT = 8
"""Offload summaries kept per deployment: those of the client's most recently reported
sessions (a client that restarts begins a new session)."""


class OffloadReports:
    """The latest offload summaries clients report for their deployments (adaptive
    offload: what ran locally, what remotely, and why)."""

    def __init__(self, core: Core) -> None:
        self._core = core

    async def record_offload(
        self, client_id: str, deployment_id: str, summary: OffloadSummary
    ) -> None:
        """Keep `summary` as the latest of its session for the client's deployment, stamped
        now. NotFound for an unknown deployment and for another client's (as `get`), also
        when it is deleted before the report is written. A report its session has a newer one
        of (more requests) changes nothing; so does the same report twice."""
        record = OffloadReportRecord(deployment_id, client_id, summary, time.time())
        if not await self._core.db(self._put_offload, record):
            raise NotFound(f"deployment {deployment_id} not found")
        logger.debug(
            "deployment=%s session=%s offload: %d remote, %d local, %d fallback(s)",
            deployment_id,
            summary.session,
            summary.remote_requests,
            summary.local_requests,
            summary.fallbacks,
        )

    def _put_offload(self, record: OffloadReportRecord) -> bool:
        """In the state thread, one transaction: the deployment is the client's and visible,
        and the report is written, or nothing is (False)."""
        with self._core.store.transaction():
            current = self._core.store.get_deployment(record.deployment_id)
            if (
                current is None
                or current.client_id != record.client_id
                or current.state not in VISIBLE
            ):
                return False
            self._core.store.put_offload_report(record, keep=OFFLOAD_SESSIONS_KEPT)
        return True

    async def offload_reports(self) -> list[OffloadReportRecord]:
        """The latest offload summary of each session of every deployment, by deployment, the
        most recently reported first (a deleted deployment's are gone with it)."""
        return await self._core.db(self._core.store.list_offload_reports)

"""Uploads: a client's model staged chunk by chunk, checked and stored once, and who owns
which model. The owner of the upload caps' use (`ClientLimits.staged`) and of the model
rows in the store."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from broker.core import Core
from broker.errors import (
    InvalidRequest,
    NotFound,
    ResourceExhausted,
)
from broker.model_store import InvalidModel, ModelStore, Upload
from broker.model_store import ModelNotFound as StoredModelNotFound
from broker.model_store import ModelTooLarge as StoredModelTooLarge
from broker.quotas import (
    ClientLimits,
    check_model_bytes,
    check_model_bytes_while_staging,
)
from broker.state import ModelRecord
from common import heap

HEAP_TRIM_DELAY_S = 1.0
"""How long after the last upload under way ended the broker trims its C heap."""


@dataclass(slots=True)
class ClientUpload:
    """One client's upload under way (`Uploads.begin_upload`): its staging file in the model
    store and the bytes it counts against the staging caps."""

    client_id: str
    upload: Upload
    stored_bytes: int | None
    """The client's models' bytes when the upload began; None when it owns this model
    already (a new copy adds nothing to its quota)."""
    staged_bytes: int = 0
    """Bytes counted in `ClientLimits.staged` for this upload, until `end_upload`."""


class Uploads:
    """Models uploaded to the broker: each client's uploads under way (staged on disk,
    counted against its caps), the models stored, and who owns which."""

    def __init__(self, core: Core, models: ModelStore, limits: ClientLimits) -> None:
        self._core = core
        self._models = models
        self._limits = limits
        self._owned: set[tuple[str, str]] = set()
        """(client id, sha256) of models the store says the client owns (`owns`)."""

    async def begin_upload(self, client_id: str, sha256: str) -> ClientUpload:
        """Open a staging file for the model `client_id` declares to hash to `sha256`.
        InvalidRequest for a malformed sha256. The caller ends it with `finish_upload` and,
        whatever ends the stream, `end_upload`."""
        # A model the client owns already adds nothing to its stored bytes.
        stored = None
        if not await self.owns(client_id, sha256):
            stored = await self._core.db(self._core.store.client_model_bytes, client_id)
        # Made last, with no await after it, so that a cancelled call leaves no file behind.
        try:
            return ClientUpload(client_id, self._models.upload(sha256), stored)
        except (InvalidModel, ValueError) as err:
            raise InvalidRequest(str(err)) from err

    async def write_upload(self, upload: ClientUpload, data: bytes) -> None:
        """Stage one chunk on disk. ResourceExhausted (the upload to be ended) when the chunk
        would pass the client's model bytes quota, its staged bytes cap or the broker's, or
        the store's size limit; the bytes are counted before they are written."""
        limits = self._limits
        if upload.stored_bytes is not None:
            check_model_bytes_while_staging(
                limits.quotas,
                upload.client_id,
                upload.stored_bytes,
                limits.staged.of(upload.client_id),
                len(data),
            )
        limits.staged.take(upload.client_id, len(data))
        upload.staged_bytes += len(data)
        try:
            await asyncio.to_thread(upload.upload.write, data)
        except StoredModelTooLarge as err:
            raise ResourceExhausted(str(err)) from err

    async def finish_upload(self, upload: ClientUpload, name: str) -> tuple[str, int, bool]:
        """Check and store the upload (sha256, loadable ONNX), then record it as its
        client's. The third value, "deduplicated", is True only when this client had
        uploaded that content before: whether another client did stays invisible.
        ResourceExhausted when a new model would take the client past its model bytes quota
        (checked again before the file is kept: another upload may have been stored
        meanwhile). The staged bytes stay counted until `end_upload`."""
        client_id, staged = upload.client_id, upload.upload
        owned = await self.owns(client_id, staged.sha256)
        if not owned:
            stored = await self._core.db(self._core.store.client_model_bytes, client_id)
            check_model_bytes(self._limits.quotas, client_id, stored, staged.size)
        try:
            result = await asyncio.to_thread(staged.commit)
        except InvalidModel as err:
            raise InvalidRequest(str(err)) from err
        except StoredModelTooLarge as err:
            raise ResourceExhausted(str(err)) from err
        await self._core.db(
            self._core.store.put_model,
            ModelRecord(result.sha256, name or result.sha256[:12], result.size_bytes, time.time()),
        )
        await self._core.db(self._core.store.add_model_owner, result.sha256, client_id)
        self._owned.add((client_id, result.sha256))
        return result.sha256, result.size_bytes, owned

    def end_upload(self, upload: ClientUpload) -> None:
        """Remove the upload's staging file (a no-op after a commit) and give back the bytes
        it counted. Idempotent; for a `finally`: finished, failed, cancelled, disconnected.
        Once no upload is under way, the memory their chunks took goes back to the system
        (`_release_memory_soon`)."""
        upload.upload.abort()
        if upload.staged_bytes:
            self._limits.staged.give_back(upload.client_id, upload.staged_bytes)
            upload.staged_bytes = 0
            if not self._limits.staged.total:
                self._release_memory_soon()

    def _release_memory_soon(self) -> None:
        """Trim the C heap `HEAP_TRIM_DELAY_S` from now if no upload is under way then: the
        calls that just ended free their buffers and connections after their bytes were
        given back. In a thread: trimming a large heap takes milliseconds."""
        loop = asyncio.get_running_loop()

        def release() -> None:
            if not self._limits.staged.total:
                with contextlib.suppress(RuntimeError):  # the loop is shutting down
                    loop.run_in_executor(None, heap.release_free_memory)

        loop.call_later(HEAP_TRIM_DELAY_S, release)

    async def owns(self, client_id: str, sha256: str) -> bool:
        """Whether the client uploaded that model. An owner is never removed, so a yes is
        remembered (every deploy asks); a no is asked of the store each time."""
        if (client_id, sha256) in self._owned:
            return True
        if not await self._core.db(self._core.store.owns_model, client_id, sha256):
            return False
        self._owned.add((client_id, sha256))
        return True

    def model_chunks(self, sha256: str) -> Iterator[bytes]:
        """Blocking generator over a stored model. NotFound when absent."""
        try:
            yield from self._models.open_chunks(sha256)
        except (StoredModelNotFound, ValueError, InvalidModel) as err:
            raise NotFound(f"model {sha256} is not stored at the broker") from err

"""A sampling client's completions, polled as one stream (``retrieve_futures``), and cancels.

SDK 0.38 clients whose server advertises ``sample_use_retrieve_futures`` run one long-poll per
sampling client instead of one per request: the server answers with the requests of that
client (its sampling session, and its number among the session's clients, which fixes the
block of ``seq_id``s it uses) that finished since the client's cursor. The cursor is the
store's finishing order (``Store.completions``), which is durable: a client that polled an
earlier run of the server still gets every result that finished since, failures of the
restart included. Results the client reports as retrieved are deleted at once.
"""

from __future__ import annotations

import asyncio

from hosted_tinker.core.errors import bad_request
from hosted_tinker.server.persistence.records import FutureRecord
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol import responses as rsp
from hosted_tinker.server.scheduler import Scheduler

SEQ_BLOCK = 1_000_000_000  # a sampling client's seq_ids: [n·SEQ_BLOCK, (n+1)·SEQ_BLOCK)
MAX_COMPLETIONS = 1000  # per answer; more are left for the next poll


class FuturesService:
    def __init__(self, store: Store, scheduler: Scheduler, poll_timeout_s: float) -> None:
        self.store = store
        self.scheduler = scheduler
        self.poll_timeout_s = poll_timeout_s

    async def completions(self, req: wire.FuturesRetrieveRequest) -> rsp.FuturesRetrieveResponse:
        """What finished after ``prev_cursor``, waiting up to the request's ``timeout`` (at most
        the server's long-poll) for something to."""
        sampler_id, clone = req.target.sampling_session_id, req.target.cloned_sampler_id
        seq_range = (clone * SEQ_BLOCK, (clone + 1) * SEQ_BLOCK)
        if req.retrieved_request_ids:
            await asyncio.to_thread(self.store.delete_finished, sampler_id, seq_range, req.retrieved_request_ids)
        timeout = self.poll_timeout_s if req.timeout is None else min(req.timeout, self.poll_timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            with self.scheduler.watch(sampler_id) as finished:
                rows = self.store.completions(sampler_id, seq_range, req.prev_cursor, MAX_COMPLETIONS)
                left = deadline - loop.time()
                if rows or left <= 0:
                    break
                try:
                    await asyncio.wait_for(finished.wait(), left)
                except TimeoutError:
                    pass
        completions: list[rsp.FutureFinished | rsp.FutureFailed] = [
            rsp.FutureFinished(request_id=request_id, response_payload_uncompressed_size=size)
            if status == "done"
            else rsp.FutureFailed(request_id=request_id)
            for _, request_id, status, size in rows
        ]
        return rsp.FuturesRetrieveResponse(completions=completions, cursor=rows[-1][0] if rows else req.prev_cursor)


def check_cancellable(record: FutureRecord) -> None:
    """Only sampling can be cancelled: a training request holds its model's place in seq_id order."""
    if record.kind != "sample":
        raise bad_request(
            f"request {record.request_id} is a {record.kind} request; only sampling requests can be cancelled"
        )

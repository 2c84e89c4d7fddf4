"""The one door to etcd: a thin asyncio facade over `aetcd` (and its gRPC stubs).

    get_prefix(prefix)            -> Snapshot(revision R, kvs)   one consistent read at R, paged
    apply(puts, deletes, lease)   -> revision                    txns of <= max_txn_ops operations
                                     (asks for LARGE_TXN_OPS; an etcd that refuses it, being
                                      at its default --max-txn-ops, gets MAX_TXN_OPS from then on)
    put(key, value, lease)        -> revision                    one key, over etcd's JSON gateway (below)
    revision(key)                 -> revision                    etcd's now, linearizable, no write (gateway)
    grant / keepalive / revoke    leases (keepalive answers the TTL left; 0: the lease is gone)
    watch_prefix(prefix, start)   -> Watch, async-iterates WatchBatch (events of one or more
                                     revisions, in order); raises RevisionCompacted
    compact(revision)

A single put and a revision read go to etcd's JSON gateway (POST /v3/kv/put, /v3/kv/range; HTTP/1.1
kept alive, prefixpool.net): a router puts or reads at the end of every request, and through gRPC's
asyncio stack either cost the caller about twice the CPU; etcd pays about 0.27 ms more a call for its
gateway, off the router's path (scripts/bench_cold_calls.py, benchmarks/tokenize.md). An etcd started
without the gateway (`--enable-grpc-gateway=false`: its 404 is not the gateway's JSON) gets gRPC from
then on.

Errors are translated once, here: EtcdUnavailable (no connection, timeout; the
caller retries and the next call reconnects, to the next endpoint when there
are several), LeaseNotFound, RevisionCompacted. Nothing else in the project
imports the client library, so it can be swapped. Knows nothing of nodes,
blocks or the key layout.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import aetcd
import msgspec
from aetcd import rpc
from aetcd.utils import prefix_range_end

from prefixpool.net.http1_client import Http1Client

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
LARGE_TXN_OPS = 1024  # what prefixpool's own etcd allows (EtcdServerConfig.max_txn_ops) and clients try first
_TOO_MANY_OPS = "too many operations in txn request"
PAGE_SIZE = 10_000
_UNAVAILABLE = {rpc.StatusCode.UNAVAILABLE, rpc.StatusCode.DEADLINE_EXCEEDED, rpc.StatusCode.CANCELLED}
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}


_UNAVAILABLE_CODES = {code.value[0] for code in _UNAVAILABLE}


class _NoGateway(Exception):
    """The endpoint answered a gateway path with something that is not etcd's JSON gateway."""


class EtcdError(Exception):
    """Anything etcd or the connection to it did wrong."""


class EtcdUnavailable(EtcdError):
    """No answer from etcd (down, unreachable, timed out, stream broken)."""


class LeaseNotFound(EtcdError):
    """The lease expired or was revoked (or etcd lost its data)."""


class RevisionCompacted(EtcdError):
    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted up to {compact_revision}")
        self.compact_revision = compact_revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    revision: int
    kvs: list[KeyValue]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    is_put: bool
    key: bytes
    value: bytes
    revision: int


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """Events of one watch response; `revision`: everything up to it has been delivered."""

    revision: int
    events: list[WatchEvent]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def translate(error: Exception) -> EtcdError:
    if isinstance(error, EtcdError):
        return error
    if isinstance(error, rpc.AioRpcError):
        details = error.details() or ""
        if "lease not found" in details:
            return LeaseNotFound(details)
        if error.code() in _UNAVAILABLE:
            return EtcdUnavailable(f"{error.code().name}: {details}")
        return EtcdError(f"{error.code().name}: {details}")
    if isinstance(error, (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, OSError, asyncio.TimeoutError)):
        return EtcdUnavailable(str(error))
    return EtcdError(repr(error))


class EtcdClient:
    """Connects lazily to endpoints ("host:port"), moving to the next one after a failure."""

    def __init__(self, endpoints: Sequence[str] | str, timeout_s: float = 5.0,
                 max_txn_ops: int = LARGE_TXN_OPS, gateway: bool = True) -> None:  # fmt: skip
        if isinstance(endpoints, str):  # "host:port,host:port", as every --etcd-endpoints flag says
            endpoints = [e.strip() for e in endpoints.split(",") if e.strip()]
        self.endpoints = list(endpoints)
        assert self.endpoints, "at least one endpoint"
        self.timeout_s = timeout_s
        self.max_txn_ops = max_txn_ops  # lowered to MAX_TXN_OPS by the first txn etcd refuses as too large
        self._current = 0
        self._client: aetcd.Client | None = None
        self._http = Http1Client(connect_timeout_s=timeout_s, read_timeout_s=timeout_s)
        self._gateway = gateway  # False (from then on) once an endpoint answered a gateway path without it

    async def _connected(self) -> aetcd.Client:
        if self._client is None:
            host, port = self.endpoints[self._current].rsplit(":", 1)
            client = aetcd.Client(host, int(port), timeout=self.timeout_s, options=_CHANNEL_OPTIONS)
            await client.connect()
            self._client = client
        return self._client

    async def _failed(self, error: Exception) -> EtcdError:
        translated = translate(error)
        if isinstance(translated, EtcdUnavailable):
            await self.close()
            self._current = (self._current + 1) % len(self.endpoints)
        return translated

    @contextlib.asynccontextmanager
    async def _translated(self) -> AsyncIterator[None]:
        """The one error path: what the library raises leaves as an EtcdError (unreachable: next endpoint)."""
        try:
            yield
        except EtcdError:
            raise
        except Exception as error:
            raise await self._failed(error) from error

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[aetcd.Client]:
        async with self._translated():
            yield await self._connected()

    async def close(self) -> None:
        await self._http.close()
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def _range(self, key: bytes, range_end: bytes, revision: int) -> rpc.RangeResponse:
        client = await self._connected()
        request = rpc.RangeRequest(key=key, range_end=range_end, revision=revision, limit=PAGE_SIZE)
        return await client.kvstub.Range(request, timeout=self.timeout_s)

    async def get_prefix(self, prefix: bytes) -> Snapshot:
        """Every key under prefix, all read at one revision (paged, so large ranges stay consistent)."""
        async with self._translated():
            end = prefix_range_end(prefix)
            response = await self._range(prefix, end, 0)
            revision = response.header.revision
            kvs = [KeyValue(kv.key, kv.value, kv.mod_revision, kv.lease) for kv in response.kvs]
            while response.more:
                response = await self._range(kvs[-1].key + b"\0", end, revision)
                kvs.extend(KeyValue(kv.key, kv.value, kv.mod_revision, kv.lease) for kv in response.kvs)
            return Snapshot(revision, kvs)

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """One key (under `lease`); the revision it made."""
        if self._gateway:
            try:
                return await self._gateway_put(key, value, lease)
            except _NoGateway:
                self._gateway = False
        return await self.apply([(key, value)], [], lease)

    async def revision(self, key: bytes) -> int:
        """etcd's revision now, read linearizably and writing nothing (a count of `key`): whatever etcd orders
        after this answer has a higher revision (a lone router orders its ends so, router/inflight.py)."""
        if self._gateway:
            try:
                reply = await self._gateway_call(b"/v3/kv/range", {"key": _b64(key), "count_only": True})
                return int(reply["header"]["revision"])
            except _NoGateway:
                self._gateway = False
        async with self._session() as client:
            request = rpc.RangeRequest(key=key, count_only=True)
            return (await client.kvstub.Range(request, timeout=self.timeout_s)).header.revision

    async def _gateway_put(self, key: bytes, value: bytes, lease: int) -> int:
        reply = await self._gateway_call(b"/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": str(lease)})
        return int(reply["header"]["revision"])

    async def _gateway_call(self, path: bytes, fields: dict) -> dict:
        """POST `fields` as JSON to the gateway's `path`; its answer, errors mapped as the gRPC ones."""
        url = f"http://{self.endpoints[self._current]}"
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._http.post(url, path, msgspec.json.encode(fields)) as response:
                    status, answer = response.status, await response.read()
        except (OSError, TimeoutError) as error:
            raise await self._failed(error) from error
        try:
            reply = msgspec.json.decode(answer)
        except msgspec.DecodeError:
            reply = None
        if status == 200 and isinstance(reply, dict) and "header" in reply:
            return reply
        if not isinstance(reply, dict) or "code" not in reply:  # not the gateway's answer: no gateway there
            raise _NoGateway(f"{url}{path.decode()} answered {status}: {answer[:80]!r}")
        message = str(reply.get("message") or reply.get("error") or "")
        if "lease not found" in message:
            raise LeaseNotFound(message)
        if reply["code"] in _UNAVAILABLE_CODES:  # gRPC's codes, as the gateway passes them on
            raise await self._failed(EtcdUnavailable(message))
        raise EtcdError(f"{status}: {message}")

    async def apply(self, puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes], lease: int = 0) -> int:
        """Puts (under `lease`) and deletes in txns of at most max_txn_ops; the revision after the last.

        A txn etcd refuses as too large was not applied at all (etcd checks before raft), so
        the same ops go again in txns of MAX_TXN_OPS."""
        ops = [rpc.RequestOp(request_put=rpc.PutRequest(key=k, value=v, lease=lease)) for k, v in puts]
        ops += [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=k)) for k in deletes]
        revision, start = 0, 0
        async with self._session() as client:
            while start < len(ops):
                size = self.max_txn_ops
                try:
                    response = await client.kvstub.Txn(rpc.TxnRequest(success=ops[start : start + size]),
                                                       timeout=self.timeout_s)  # fmt: skip
                except rpc.AioRpcError as error:
                    if size <= MAX_TXN_OPS or _TOO_MANY_OPS not in (error.details() or ""):
                        raise
                    self.max_txn_ops = MAX_TXN_OPS
                    continue
                revision, start = response.header.revision, start + size
        return revision

    async def delete_prefix(self, prefix: bytes) -> int:
        async with self._session() as client:
            request = rpc.DeleteRangeRequest(key=prefix, range_end=prefix_range_end(prefix))
            return (await client.kvstub.DeleteRange(request, timeout=self.timeout_s)).header.revision

    async def grant(self, ttl_s: int) -> int:
        async with self._session() as client:
            response = await client.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl_s), timeout=self.timeout_s)
            return response.ID

    async def keepalive(self, lease_id: int) -> int:
        """Refresh the lease once; the TTL it now has. Raises LeaseNotFound when it is gone."""
        async with self._session() as client:
            requests = iter([rpc.LeaseKeepAliveRequest(ID=lease_id)])
            call = client.leasestub.LeaseKeepAlive(requests, timeout=self.timeout_s)
            async for reply in call:
                if reply.TTL <= 0:
                    raise LeaseNotFound(f"lease {lease_id:x} is gone")
                return reply.TTL
        raise EtcdUnavailable("keepalive stream closed without an answer")

    async def revoke(self, lease_id: int) -> int:
        """Revoke (deleting its keys); the revision after. A lease already gone is not an error (0)."""
        try:
            async with self._session() as client:
                request = rpc.LeaseRevokeRequest(ID=lease_id)
                return (await client.leasestub.LeaseRevoke(request, timeout=self.timeout_s)).header.revision
        except LeaseNotFound:
            return 0

    async def compact(self, revision: int) -> None:
        async with self._session() as client:
            await client.kvstub.Compact(rpc.CompactionRequest(revision=revision, physical=True), timeout=self.timeout_s)

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> "Watch":
        async with self._session() as client:
            return Watch(self, rpc.WatchStub(client.channel), prefix, start_revision)


class Watch:
    """One watch stream over a prefix from a revision (inclusive). Iterate it for WatchBatch."""

    def __init__(self, owner: EtcdClient, stub: rpc.WatchStub, prefix: bytes, start_revision: int) -> None:
        self._owner = owner
        self._requests: asyncio.Queue = asyncio.Queue()
        create = rpc.WatchCreateRequest(key=prefix, range_end=prefix_range_end(prefix), start_revision=start_revision)
        self._requests.put_nowait(rpc.WatchRequest(create_request=create))
        self._call = stub.Watch(self._outgoing())

    async def _outgoing(self) -> AsyncIterator[rpc.WatchRequest]:
        while (request := await self._requests.get()) is not None:
            yield request

    def cancel(self) -> None:
        self._requests.put_nowait(None)
        self._call.cancel()

    async def __aiter__(self) -> AsyncIterator[WatchBatch]:
        async with self._owner._translated():
            async for response in self._call:
                if response.compact_revision:
                    raise RevisionCompacted(response.compact_revision)
                if response.canceled:
                    raise EtcdUnavailable(f"watch canceled by etcd: {response.cancel_reason}")
                if response.created or not response.events:
                    continue  # etcd 3.5.1 may send progress for unsynced watchers (etcd#15220): no revision from it
                events = [WatchEvent(e.type == rpc.Event.PUT, e.kv.key, e.kv.value, e.kv.mod_revision)
                          for e in response.events]  # fmt: skip
                yield WatchBatch(max(e.revision for e in events), events)
        raise EtcdUnavailable("watch stream ended")

"""A job's coordination state in Redis, and the one place that knows the key schema.

Every key of a job lives under the prefix ``pstrain:{job}:``:

| key | type | holds |
| --- | --- | --- |
| ``spec`` | string | the JobSpec as JSON |
| ``leader`` | string | the id of the scheduler holding the leader lease (expires) |
| ``servers`` | hash | shard -> JSON {address, incarnation, pid, host, restored[, resharded_from]} |
| ``workers`` | hash | rank -> JSON {incarnation, pid, host} |
| ``hb:{role}:{id}`` | string | the latest heartbeat as JSON; expires after the misses allowed |
| ``events`` | stream | joined, dead, restored, resharded, rollback, checkpoint, claimed, left... |
| ``checkpoint:request`` | string | JSON {id, clock[, full]} of the newest checkpoint asked for |
| ``checkpoints`` | sorted set | checkpoint ids by time of completion of their first shard |
| ``checkpoint:{id}`` | hash | shard -> JSON entry {path, sha256, nbytes, clock, run, ...} (below) |
| ``generation`` | integer | raised by each sync rollback, never to a used value; workers restart |
| ``rank:{rank}`` | string | the `pstrain worker` holding the rank: {holder, pid, host}; expires |
| ``finished`` | set | ranks done (`ctx.finish()`, or exit status 0); never claimed again |
| ``left`` | hash | rank -> JSON {incarnation, clock, time[, exited]} of the process that finished |
| ``voided`` | hash | rank -> the incarnation whose finish a sync rollback took back (it retrains) |
| ``live`` | string | JSON list of the ranks the scheduler counts live (not dead or finished) |
| ``barrier:{name}:{round}`` | hash | rank -> incarnation of each worker there; expires |
| ``fenced`` | hash | rank -> the newest incarnation declared dead: it never rejoins, it restarts |
| ``suspects`` | hash | "{role}:{id}" -> JSON {incarnation, since, clock} of each silent process |
| ``suspicions`` | hash | "{role}:{id}" -> how many times the process was suspect |
| ``membership`` | list | JSON {time, clock, worker, change, incarnation} per change of workers |
| ``run`` | string | JSON {id, started, previous, resumed_from} of the job's current run |
| ``bad`` | hash | checkpoint id -> JSON {reason, shard, time}: failed verification; not retried |
| ``stopped`` | string | JSON {reason, time}: no checkpoint verifies, so the job ends |

A checkpoint entry also holds, for a delta, its ``kind`` ("delta"), ``base`` (the id it
builds on) and ``chain`` (the ids of every checkpoint it needs, full one first), and, in a
job with a secret, its ``mac`` (scheduler/recovery.py's `sign_entry`).

Blocking calls with a socket timeout; thread-safe (redis-py pools connections).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis
import redis.exceptions

from scheduler.errors import JobExistsError, RedisUnavailableError
from scheduler.finishing import exit_record
from scheduler.membership import MEMBERSHIP_KEPT
from scheduler.spec import JobSpec

log = logging.getLogger(__name__)

T = TypeVar("T")

# What `claim_rank` answers instead of a rank.
NO_FREE_RANK = -1
ALL_FINISHED = -2

# What a lost or restarting Redis raises; callers that must ride out an outage catch these.
REDIS_DOWN: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    OSError,
)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# Takes the lowest rank that is neither finished nor held (by a `pstrain worker` claim or a
# live heartbeat). KEYS: finished set, then the W rank keys, then the W heartbeat keys.
# ARGV: the holder's JSON, the time to live in ms, W. Returns the rank, -1 when every
# unfinished rank is held, -2 when every rank has finished.
_CLAIM_RANK = """
local w = tonumber(ARGV[3])
local finished = 0
for r = 0, w - 1 do
  if redis.call('SISMEMBER', KEYS[1], tostring(r)) == 1 then
    finished = finished + 1
  elseif redis.call('EXISTS', KEYS[2 + r]) == 0 and redis.call('EXISTS', KEYS[2 + w + r]) == 0 then
    redis.call('SET', KEYS[2 + r], ARGV[1], 'PX', ARGV[2])
    return r
  end
end
if finished == w then
  return -2
end
return -1
"""

# Extends a rank claim still held by ARGV[1] (1); takes it back if it lapsed and nobody took
# it meanwhile (2); 0 when another worker holds it now.
_RENEW_RANK = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not held then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return 0
"""

# Ends a rank claim held by ARGV[1], or one that lapsed with nobody taking it; with ARGV[2] ==
# '1' the rank joins the finished set. 0, changing nothing, when another worker holds the rank.
_END_RANK = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then
  return 0
end
if ARGV[2] == '1' then
  redis.call('SADD', KEYS[2], ARGV[3])
end
if held then
  redis.call('DEL', KEYS[1])
end
return 1
"""

# Raises a fenced incarnation, never lowers it. KEYS: the fenced hash; ARGV: rank, incarnation.
_FENCE = """
local held = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if tonumber(ARGV[2]) > held then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
return 1
"""

# A worker's finish record, unless a rollback voided that incarnation's finish. KEYS: the
# finished set, the left hash, the voided hash; ARGV: rank, incarnation, record (JSON).
_FINISH = """
if redis.call('HGET', KEYS[3], ARGV[1]) == ARGV[2] then
  return 0
end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return 1
"""

# Voids the finish of one incarnation of a rank: its record goes, and it may not write it
# again. KEYS: the finished set, the left hash, the voided hash; ARGV: rank, incarnation.
# Returns 0 (nothing done) when the record is of another incarnation or absent.
_VOID_FINISH = """
local record = redis.call('HGET', KEYS[2], ARGV[1])
if not record or cjson.decode(record)['incarnation'] ~= tonumber(ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[1], ARGV[1])
return 1
"""

# The heartbeat-key claim of `worker.init()`, which also leaves alone ranks held by a
# `pstrain worker` claim and ranks that have finished. KEYS: heartbeat, rank key, finished
# set; ARGV: payload, time to live in ms, rank.
_CLAIM_BEAT = """
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('SISMEMBER', KEYS[3], ARGV[3]) == 1 then
  return 0
end
if redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'NX') then
  return 1
end
return 0
"""


# A failed TLS handshake reaches us as a bare socket error (a missing client certificate as
# "tlsv13 alert certificate required" or "EOF occurred in violation of protocol", a plain
# client at a TLS port as "Connection reset by peer"), so the message says what to check.
_HINTS = {
    "rediss": "; over TLS also that ssl_ca_certs is the CA that signed the server's certificate "
              "and, where the server checks clients (tls-auth-clients), that ssl_certfile and "
              "ssl_keyfile name a certificate and key its CA signed",
    "redis": " (a TLS port needs rediss://)",
}
_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def _check_tls_query(url: str) -> None:
    """Refuses ssl_* parameters without rediss://, and TLS files that are missing (redis-py's
    own error names neither the parameter nor the path, and comes only after the timeout)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    if parts.scheme != "rediss" and any(name.startswith("ssl_") for name in query):
        raise RedisUnavailableError(
            f"Redis URL {redact(url)!r} has ssl_* parameters but no TLS; use rediss://"
        )
    for name in _TLS_FILES:
        for path in query.get(name, [])[:1]:
            if not os.path.isfile(path):
                raise RedisUnavailableError(
                    f"{name}={path!r} in Redis URL {redact(url)!r} is not a file; give the "
                    "path of the PEM file (percent-encoded)"
                )


def redact(url: str) -> str:
    """The URL with any password replaced (before the host, or as a `password=` query
    parameter, which redis-py also takes), for messages and logs."""
    url = re.sub(r"([?&]password=)[^&#]*", r"\1***", url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


@dataclass(frozen=True)
class Keys:
    job: str

    @property
    def prefix(self) -> str:
        return f"pstrain:{self.job}:"

    def spec(self) -> str:
        return self.prefix + "spec"

    def leader(self) -> str:
        return self.prefix + "leader"

    def members(self, role: str) -> str:
        return f"{self.prefix}{role}s"

    def heartbeat(self, role: str, ident: int | str) -> str:
        return f"{self.prefix}hb:{role}:{ident}"

    def events(self) -> str:
        return self.prefix + "events"

    def checkpoint_request(self) -> str:
        return self.prefix + "checkpoint:request"

    def checkpoints(self) -> str:
        return self.prefix + "checkpoints"

    def checkpoint(self, checkpoint_id: str) -> str:
        return f"{self.prefix}checkpoint:{checkpoint_id}"

    def generation(self) -> str:
        return self.prefix + "generation"

    def rank(self, rank: int) -> str:
        return f"{self.prefix}rank:{rank}"

    def finished(self) -> str:
        return self.prefix + "finished"

    def fenced(self) -> str:
        return self.prefix + "fenced"

    def suspects(self) -> str:
        return self.prefix + "suspects"

    def suspicions(self) -> str:
        return self.prefix + "suspicions"

    def membership(self) -> str:
        return self.prefix + "membership"

    def left(self) -> str:
        return self.prefix + "left"

    def voided(self) -> str:
        return self.prefix + "voided"

    def live(self) -> str:
        return self.prefix + "live"

    def barrier(self, name: str, round_: int) -> str:
        return f"{self.prefix}barrier:{name}:{round_}"

    def run(self) -> str:
        return self.prefix + "run"

    def bad(self) -> str:
        return self.prefix + "bad"

    def stopped(self) -> str:
        return self.prefix + "stopped"

    def served(self) -> str:
        return self.prefix + "served"


@dataclass(frozen=True)
class Event:
    id: str
    time_s: float
    type: str
    role: str
    member: str
    detail: dict[str, Any]


class JobStore:
    """Reads and writes one job's keys. Construct with `connect`."""

    def __init__(self, client: redis.Redis, url: str, job: str) -> None:
        self.redis = client
        self.url = url
        self.keys = Keys(job)

    @classmethod
    def connect(cls, url: str, job: str, timeout_s: float = 5.0) -> JobStore:
        """Connects and pings; RedisUnavailableError naming the URL if that fails in time.

        Accepts redis://, rediss:// (TLS) and unix:// URLs, with a password or an ACL user and
        password in the URL (redis://user:secret@host:6379/0). TLS takes its files from
        redis-py's query parameters, paths percent-encoded:
        rediss://host:6380/0?ssl_ca_certs=ca.pem&ssl_certfile=worker.pem&ssl_keyfile=worker.key
        """
        _check_tls_query(url)
        try:
            client = redis.Redis.from_url(
                url, socket_connect_timeout=min(2.0, timeout_s), socket_timeout=2.0,
                health_check_interval=10, decode_responses=True,
            )
        except ValueError as exc:
            raise RedisUnavailableError(
                f"cannot use Redis URL {redact(url)!r}: {exc}. Use redis://HOST:PORT/DB, "
                "rediss:// for TLS, optionally with user:password@"
            ) from exc
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return cls(client, url, job)
            except redis.exceptions.AuthenticationError as exc:
                raise RedisUnavailableError(
                    f"Redis at {redact(url)} refused the credentials: {exc}"
                ) from exc
            except REDIS_DOWN as exc:
                if time.monotonic() + 0.5 > deadline:
                    raise RedisUnavailableError(
                        f"cannot reach Redis at {redact(url)} within {timeout_s:g} s ({exc}); "
                        "check the URL, that redis-server runs, and the network"
                        + _HINTS.get(urlsplit(url).scheme, "")
                    ) from exc
                time.sleep(0.25)
            except (TypeError, redis.exceptions.RedisError) as exc:
                # redis-py hands unknown query parameters to the connection as keyword arguments
                # and checks some values (ssl_cert_reqs) only when it first connects.
                raise RedisUnavailableError(
                    f"cannot use Redis URL {redact(url)!r}: {exc}. Use redis://HOST:PORT/DB, "
                    "rediss:// for TLS, optionally with user:password@"
                ) from exc

    # ---- the spec ----------------------------------------------------------------------------

    def spec(self) -> JobSpec | None:
        raw = self.redis.get(self.keys.spec())
        return None if raw is None else JobSpec.from_json(raw)

    def put_spec(self, spec: JobSpec) -> None:
        self.redis.set(self.keys.spec(), spec.to_json())

    def create_job(
        self, spec: JobSpec, *, adopt: bool, given: Mapping[str, object] | None = None,
        resumed_from: str = "",
    ) -> JobSpec:
        """Stores `spec` as the job's, or checks it against the stored one.

        With adopt=False (a new job) a job of that name that is live (a leader holds its
        lease, or a process heartbeats) is refused. With adopt=True an existing spec must
        agree with the values in `given` (the flags a user set); the stored one is returned.
        One exception: a job that is not live may be adopted with another number of
        `servers` (a stopped job resumed on more or fewer servers): the stored spec takes
        it, and Redis forgets the job's checkpoints (their files stay; the servers find them
        on disk and reshard them) and its servers' registrations.
        A new job is a new run: it gets a run id (`JobSpec.run_id`, recorded under ``run``
        with the run before it and `resumed_from`, the checkpoint a resumed run starts from).
        """
        held = self.spec()
        if held is not None and adopt:
            given = dict(given or {})
            servers = given.get("servers")
            if isinstance(servers, int) and servers != held.servers and not self.is_live():
                del given["servers"]
                held.check_agrees(**given)
                return self._rescale(held, servers)
            held.check_agrees(**given)
            return held
        if held is not None and self.is_live():
            raise JobExistsError(
                f"job {spec.job!r} is running (its scheduler or processes still heartbeat in "
                f"Redis at {redact(self.url)}); choose another --job, or stop it first"
            )
        previous = self.run()
        if not spec.created_s:
            spec = dataclasses.replace(spec, created_s=time.time())
        if not spec.run_id:
            spec = dataclasses.replace(spec, run_id=new_run_id(spec.created_s))
        # A new job under an old name starts fresh: with every rank still to run, without the
        # earlier run's checkpoints (their files stay; --resume carries on from them), and
        # without its members, which a scheduler taking over would declare dead (a sync
        # quorum without them) until this run's register, nor its rank claims or requests.
        forgotten = self.checkpoint_ids()
        pipe = self.redis.pipeline(transaction=False)
        for checkpoint_id in forgotten:
            pipe.delete(self.keys.checkpoint(checkpoint_id))
        for pattern in ("rank:*", "barrier:*"):
            for key in self.redis.scan_iter(f"{self.keys.prefix}{pattern}", count=100):
                pipe.delete(key)
        pipe.delete(self.keys.checkpoints(), self.keys.finished(), self.keys.members("worker"),
                    self.keys.members("server"), self.keys.checkpoint_request(),
                    self.keys.left(), self.keys.live(), self.keys.voided())
        pipe.delete(self.keys.fenced(), self.keys.suspects(), self.keys.suspicions(),
                    self.keys.membership(), self.keys.bad(), self.keys.stopped(),
                    self.keys.served())
        pipe.set(self.keys.run(), json.dumps({
            "id": spec.run_id, "started": spec.created_s,
            "previous": "" if previous is None else previous.get("id", ""),
            "resumed_from": resumed_from}))
        pipe.execute()
        if held is not None and not resumed_from:
            before = "" if previous is None else f" (run {previous.get('id', '?')})"
            resume = "--resume" + (f" or --resume-from {previous['id']}"
                                   if previous and previous.get("id") else "")
            log.warning("job %r: new run %s under the name of an earlier one%s; it starts from "
                        "fresh rows, not from that run's %d checkpoint(s) (%s carries on from "
                        "them)", spec.job, spec.run_id, before, len(forgotten), resume)
        self.put_spec(spec)
        return spec

    def _rescale(self, held: JobSpec, servers: int) -> JobSpec:
        """`held` with `servers` servers, stored. Checkpoints listed for the old count
        (entries signed for it) go from Redis: a listing of a checkpoint of another count
        could pass for a complete or partial one of the new count."""
        spec = dataclasses.replace(held, servers=servers)
        pipe = self.redis.pipeline(transaction=False)
        for checkpoint_id in self.checkpoint_ids():
            pipe.delete(self.keys.checkpoint(checkpoint_id))
        pipe.delete(self.keys.checkpoints(), self.keys.members("server"),
                    self.keys.checkpoint_request(), self.keys.served())
        pipe.set(self.keys.spec(), spec.to_json())
        pipe.execute()
        log.warning("job %r: %d servers now, not %d; each restores its share of the newest "
                    "checkpoint from the checkpoint directory (resharded)", held.job, servers,
                    held.servers)
        return spec

    def run(self) -> dict[str, Any] | None:
        """{id, started, previous, resumed_from} of the job's current run, None if unknown."""
        raw = self.redis.get(self.keys.run())
        return None if raw is None else dict(json.loads(raw))

    def is_live(self) -> bool:
        if self.redis.exists(self.keys.leader()):
            return True
        return any(True for _ in self.redis.scan_iter(self.keys.heartbeat("*", "*"), count=100))

    # ---- members and heartbeats --------------------------------------------------------------

    def register(self, role: str, ident: int, info: Mapping[str, Any]) -> None:
        self.redis.hset(self.keys.members(role), str(ident), json.dumps(dict(info)))

    def members(self, role: str) -> dict[int, dict[str, Any]]:
        raw = self.redis.hgetall(self.keys.members(role))
        return {int(k): json.loads(v) for k, v in raw.items()}

    def beat(
        self, role: str, ident: int, payload: Mapping[str, Any], ttl_s: float,
        registration: Mapping[str, Any] | None = None, name: str = "",
    ) -> None:
        """Refreshes a heartbeat (and the registration, so an emptied Redis refills itself).

        With `name`, also names the connection the beat went through (CLIENT SETNAME): the
        failure detector tells a paused process (its connection open) from an exited one by
        it. A Redis that refuses the name (an ACL) is logged once; the beat still counts.
        """
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(role, ident), json.dumps(dict(payload)),
                 px=max(1, int(ttl_s * 1000)))
        if registration is not None:
            pipe.hset(self.keys.members(role), str(ident), json.dumps(dict(registration)))
        if name:
            pipe.client_setname(name)
        results = pipe.execute(raise_on_error=False)
        failed = [r for r in results[:-1 if name else None] if isinstance(r, Exception)]
        if failed:
            raise failed[0]
        if name and isinstance(results[-1], Exception) and not _warned.get("setname"):
            _warned["setname"] = True
            log.warning("Redis refused CLIENT SETNAME (%s): a silent process is declared dead "
                        "only after --suspect-timeout-s, not as soon as it exits",
                        results[-1])

    def claim(self, role: str, ident: int, payload: Mapping[str, Any], ttl_s: float) -> bool:
        """Takes `ident` if no live process holds it (its heartbeat key is the claim).

        A worker rank held by a `pstrain worker` claim (`claim_rank`) or finished is not taken.
        """
        ttl_ms = max(1, int(ttl_s * 1000))
        if role != "worker":
            return bool(self.redis.set(self.keys.heartbeat(role, ident),
                                       json.dumps(dict(payload)), px=ttl_ms, nx=True))
        return bool(self.redis.eval(
            _CLAIM_BEAT, 3, self.keys.heartbeat(role, ident), self.keys.rank(ident),
            self.keys.finished(), json.dumps(dict(payload)), ttl_ms, ident,
        ))

    def heartbeats(self, role: str, idents: list[int]) -> dict[int, dict[str, Any] | None]:
        """The latest heartbeat of each member, None where it has lapsed."""
        if not idents:
            return {}
        raw = self.redis.mget([self.keys.heartbeat(role, i) for i in idents])
        return {i: (None if r is None else json.loads(r)) for i, r in zip(idents, raw, strict=True)}

    def forget(self, role: str, ident: int, *, hang_up: bool = False) -> None:
        """Deletes a heartbeat. With `hang_up`, also closes the idle connections (those the
        beats named among them): the process has left, and the failure detector need not
        wait to see its connections close. Later calls open new, unnamed ones."""
        self.redis.delete(self.keys.heartbeat(role, ident))
        if hang_up:
            self.redis.connection_pool.disconnect(inuse_connections=False)

    def client_names(self) -> set[str] | None:
        """The names of the connections Redis holds open (CLIENT LIST); None where Redis
        refuses to say (an ACL, a proxy): then no silence is known to be an exit."""
        try:
            clients = self.redis.client_list(_type="normal")
        except redis.exceptions.ResponseError as exc:
            if not _warned.get("client list"):
                _warned["client list"] = True
                log.warning("Redis refused CLIENT LIST (%s): a silent process is declared "
                            "dead only after --suspect-timeout-s", exc)
            return None
        return {str(c.get("name", "")) for c in clients if c.get("name")}

    # ---- failure detection: suspects, fenced incarnations, membership changes ---------------

    def set_suspect(self, role: str, ident: int, detail: Mapping[str, Any] | None) -> None:
        """Records (and counts) that a process is suspect, or with None that it is no longer."""
        if detail is None:
            self.redis.hdel(self.keys.suspects(), f"{role}:{ident}")
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.suspects(), f"{role}:{ident}", json.dumps(dict(detail)))
        pipe.hincrby(self.keys.suspicions(), f"{role}:{ident}", 1)
        pipe.execute()

    def suspicion_counts(self) -> dict[str, int]:
        """"{role}:{id}" -> how many times that process was suspect."""
        return {_text(k): int(v) for k, v in self.redis.hgetall(self.keys.suspicions()).items()}

    def suspects(self) -> dict[tuple[str, int], dict[str, Any]]:
        """(role, id) -> {incarnation, since, clock} of each process suspect now."""
        raw = self.redis.hgetall(self.keys.suspects())
        out = {}
        for key, value in raw.items():
            role, _, ident = _text(key).partition(":")
            out[(role, int(ident))] = dict(json.loads(value))
        return out

    def fence_worker(self, rank: int, incarnation: int) -> None:
        """Records that `incarnation` of worker `rank` was declared dead: it, and any older
        one, must restart (a new incarnation) to take part again."""
        self.redis.eval(_FENCE, 1, self.keys.fenced(), rank, incarnation)

    def fenced_workers(self) -> dict[int, int]:
        """Rank -> the newest incarnation declared dead."""
        return {int(k): int(v) for k, v in self.redis.hgetall(self.keys.fenced()).items()}

    def fenced_incarnation(self, rank: int) -> int:
        """The newest incarnation of `rank` declared dead; -1 when none was."""
        raw = self.redis.hget(self.keys.fenced(), str(rank))
        return -1 if raw is None else int(raw)

    def record_served(self, incarnations: Mapping[int, int]) -> None:
        """Records, for each shard in `incarnations`, the incarnation whose start the job
        has accounted for (a sync job: rolled back for); a leader that takes over compares
        the servers it finds with these."""
        if incarnations:
            self.redis.hset(self.keys.served(),
                            mapping={str(k): v for k, v in incarnations.items()})

    def served_incarnations(self) -> dict[int, int]:
        """Shard -> the incarnation recorded by `record_served`."""
        return {int(k): int(v) for k, v in self.redis.hgetall(self.keys.served()).items()}

    def record_membership(self, entry: Mapping[str, Any]) -> None:
        """Appends one change of the workers (the newest MEMBERSHIP_KEPT are kept)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(self.keys.membership(), json.dumps(dict(entry)))
        pipe.ltrim(self.keys.membership(), -MEMBERSHIP_KEPT, -1)
        pipe.execute()

    def put_membership(self, changes: Iterable[Mapping[str, Any]]) -> None:
        """Replaces the changes of the workers with `changes` (oldest first), at once."""
        entries = [json.dumps(dict(c)) for c in changes]
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.keys.membership())
        if entries:
            pipe.rpush(self.keys.membership(), *entries)
        pipe.execute()

    def membership_changes(self) -> list[dict[str, Any]]:
        """The changes of the workers, oldest first."""
        return [dict(json.loads(e)) for e in self.redis.lrange(self.keys.membership(), 0, -1)]

    # ---- worker ranks ------------------------------------------------------------------------

    def claim_rank(self, workers: int, holder: str, ttl_s: float) -> int:
        """Atomically takes the lowest free rank of `workers` for `holder` (a JSON string).

        Free: not finished, no claim and no live heartbeat. Returns the rank, NO_FREE_RANK when
        every unfinished rank is held, or ALL_FINISHED. The claim expires after `ttl_s` unless
        renewed.
        """
        keys = [self.keys.finished(), *(self.keys.rank(r) for r in range(workers)),
                *(self.keys.heartbeat("worker", r) for r in range(workers))]
        return int(self.redis.eval(_CLAIM_RANK, len(keys), *keys, holder,
                                   max(1, int(ttl_s * 1000)), workers))

    def renew_rank(self, rank: int, holder: str, ttl_s: float) -> int:
        """Extends `holder`'s claim: 1 renewed, 2 taken back after it lapsed, 0 lost."""
        return int(self.redis.eval(_RENEW_RANK, 1, self.keys.rank(rank), holder,
                                   max(1, int(ttl_s * 1000))))

    def end_rank(self, rank: int, holder: str, *, finished: bool) -> bool:
        """Drops `holder`'s claim; with `finished` the rank is never claimed again. False,
        changing nothing, when another worker holds the rank now (`holder`'s lapsed and was
        taken): that worker runs the rank, so this one's end is not the rank's."""
        return bool(self.redis.eval(_END_RANK, 2, self.keys.rank(rank), self.keys.finished(),
                                    holder, "1" if finished else "0", rank))

    def rank_holders(self, workers: int) -> dict[int, dict[str, Any]]:
        """The current claim of each claimed rank."""
        raw = self.redis.mget([self.keys.rank(r) for r in range(workers)])
        return {r: json.loads(v) for r, v in enumerate(raw) if v is not None}

    def finished_ranks(self) -> set[int]:
        return {int(_text(r)) for r in self.redis.smembers(self.keys.finished())}

    # ---- finishing and barriers --------------------------------------------------------------

    def finish_worker(self, rank: int, incarnation: int, clock: int) -> bool:
        """Records that worker `rank` (this `incarnation`) finished at `clock`: the rank is
        never claimed again, and the scheduler takes it out of the membership. False (nothing
        written) when a sync rollback voided this incarnation's finish (`void_finish`)."""
        record = json.dumps({"incarnation": incarnation, "clock": clock, "time": time.time()})
        keys = (self.keys.finished(), self.keys.left(), self.keys.voided())
        return bool(self.redis.eval(_FINISH, 3, *keys, rank, incarnation, record))

    def void_finish(self, rank: int, incarnation: int) -> bool:
        """Takes back the finish that `incarnation` of worker `rank` recorded (a sync rollback
        went to a checkpoint before it): the rank is unfinished again, and that incarnation
        cannot record its finish any more. False when its record is not there (another
        incarnation's, or none)."""
        keys = (self.keys.finished(), self.keys.left(), self.keys.voided())
        return bool(self.redis.eval(_VOID_FINISH, 3, *keys, rank, incarnation))

    def mark_finished(self, rank: int, holder: str | None = None) -> bool:
        """Records that rank `rank`'s script exited with status 0 (the process is gone), and
        drops the last beat it left at exit: the scheduler announces the finish at its next
        poll instead of when that beat lapses (a job may end before then). A script that
        returned without `ctx.finish()` gets the finish record that call would have written,
        with the clock of that last beat (`exit_record`).

        `holder`: the `pstrain worker` claim the script ran under, dropped with the mark (as
        `end_rank` would). When another worker holds the rank now (this one's claim lapsed,
        a partition from Redis, and a spare took it), the beat is the spare's and the rank is
        its to finish: False, and nothing changes. Otherwise nobody can have beaten for the
        rank since (a finished rank is never claimed again, a held one only by its holder),
        so the beat is the exited process's."""
        finished, left, voided = self.keys.finished(), self.keys.left(), self.keys.voided()
        beat_key = self.keys.heartbeat("worker", rank)
        claim_key = self.keys.rank(rank)

        def mark(pipe: Any) -> Any:  # bool: marked (redis-py types the callable as -> None)
            held = pipe.get(claim_key) if holder is not None else None
            if held is not None and _text(held) != holder:
                return False  # nothing queued: the transaction changes nothing
            beat = pipe.get(beat_key)
            record = pipe.hget(left, str(rank))
            void = pipe.hget(voided, str(rank))
            entry = exit_record(None if beat is None else json.loads(beat),
                                None if record is None else json.loads(record),
                                None if void is None else int(void), time.time())
            pipe.multi()
            pipe.sadd(finished, str(rank))
            pipe.delete(beat_key)
            if held is not None:
                pipe.delete(claim_key)
            if entry is not None:
                pipe.hset(left, str(rank), json.dumps(entry))
            return True

        return bool(self.redis.transaction(mark, beat_key, left, voided, claim_key,
                                           value_from_callable=True))

    def departures(self) -> tuple[set[int], dict[int, dict[str, Any]]]:
        """The finished ranks, and rank -> {incarnation, clock, time} of each worker that
        called `ctx.finish()`, read together: a `finish_worker` lands in both or in neither
        (read apart, a finish between the reads shows a finished rank with no record of the
        clock it finished at)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.smembers(self.keys.finished())
        pipe.hgetall(self.keys.left())
        finished, left = pipe.execute()
        return ({int(_text(r)) for r in finished},
                {int(k): json.loads(v) for k, v in left.items()})

    def set_live_workers(self, ranks: list[int]) -> None:
        self.redis.set(self.keys.live(), json.dumps(sorted(ranks)))

    def live_workers(self) -> list[int] | None:
        """The ranks the scheduler counts live; None before it has said."""
        raw = self.redis.get(self.keys.live())
        return None if raw is None else [int(r) for r in json.loads(raw)]

    def arrive(self, name: str, round_: int, rank: int, incarnation: int, ttl_s: float) -> None:
        """Records that `rank` (this `incarnation`) reached round `round_` of barrier `name`;
        the round's record expires `ttl_s` after its latest arrival."""
        key = self.keys.barrier(name, round_)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, str(rank), str(incarnation))
        pipe.expire(key, max(1, int(ttl_s)))
        pipe.execute()

    def barrier_state(self, name: str, round_: int) -> tuple[
        dict[int, int], list[int] | None, dict[int, int], dict[int, int]
    ]:
        """What a barrier waits on, read at once: (rank -> incarnation arrived, the live
        ranks or None, rank -> incarnation that finished, rank -> registered incarnation)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self.keys.barrier(name, round_))
        pipe.get(self.keys.live())
        pipe.hgetall(self.keys.left())
        pipe.hgetall(self.keys.members("worker"))
        arrived, live, left, members = pipe.execute()
        return (
            {int(k): int(v) for k, v in arrived.items()},
            None if live is None else [int(r) for r in json.loads(live)],
            {int(k): int(json.loads(v).get("incarnation", 0)) for k, v in left.items()},
            {int(k): int(json.loads(v).get("incarnation", 0)) for k, v in members.items()},
        )

    # ---- events ------------------------------------------------------------------------------

    def event(self, kind: str, role: str, member: int | str, **detail: Any) -> None:
        self.redis.xadd(
            self.keys.events(),
            {"type": kind, "role": role, "member": str(member), "time": f"{time.time():.6f}",
             "detail": json.dumps(detail)},
            maxlen=100_000, approximate=True,
        )

    def events(self, after: str = "-", count: int = 1000) -> list[Event]:
        """Events after id `after` ("-" from the start), oldest first."""
        start = "-" if after == "-" else f"({after}"
        return [_event(eid, fields)
                for eid, fields in self.redis.xrange(self.keys.events(), start, "+",
                                                     count=count) or []]

    def recent_events(self, count: int) -> list[Event]:
        """The newest `count` events, oldest first."""
        newest = self.redis.xrevrange(self.keys.events(), "+", "-", count=count) or []
        return [_event(eid, fields) for eid, fields in reversed(newest)]

    # ---- the leader lease --------------------------------------------------------------------

    def acquire_lease(self, holder: str, ttl_s: float) -> bool:
        return bool(self.redis.set(self.keys.leader(), holder, nx=True, px=int(ttl_s * 1000)))

    def renew_lease(self, holder: str, ttl_s: float) -> bool:
        return bool(self.redis.eval(_RENEW, 1, self.keys.leader(), holder, int(ttl_s * 1000)))

    def leader(self) -> str | None:
        raw = self.redis.get(self.keys.leader())
        return None if raw is None else _text(raw)

    # ---- rollbacks ---------------------------------------------------------------------------

    def generation(self) -> int:
        """How many sync rollbacks the job has had."""
        raw = self.redis.get(self.keys.generation())
        return 0 if raw is None else int(raw)

    def set_generation(self, generation: int) -> None:
        self.redis.set(self.keys.generation(), generation)

    # ---- checkpoints -------------------------------------------------------------------------

    def request_checkpoint(self, checkpoint_id: str, clock: int, full: bool = False) -> None:
        """Asks the servers for checkpoint `checkpoint_id` at sync clock `clock` (-1: now);
        `full`: a full one, not a delta."""
        request: dict[str, Any] = {"id": checkpoint_id, "clock": clock, "time": time.time()}
        if full:
            request["full"] = True
        self.redis.set(self.keys.checkpoint_request(), json.dumps(request))

    def checkpoint_request(self) -> dict[str, Any] | None:
        raw = self.redis.get(self.keys.checkpoint_request())
        return None if raw is None else dict(json.loads(raw))

    def record_checkpoint(self, checkpoint_id: str, shard: int, entry: Mapping[str, Any]) -> None:
        """Lists shard `shard`'s entry of a checkpoint just written; a bad mark of an earlier
        checkpoint under the same id (written again after a rollback) goes."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hdel(self.keys.bad(), checkpoint_id)
        pipe.hset(self.keys.checkpoint(checkpoint_id), str(shard), json.dumps(dict(entry)))
        pipe.zadd(self.keys.checkpoints(), {checkpoint_id: time.time()}, nx=True)
        pipe.execute()

    def relist_checkpoint(self, checkpoint_id: str, entries: Mapping[int, Mapping[str, Any]]
                          ) -> None:
        """Lists a checkpoint's entries again where Redis lacks them (it came back empty);
        entries and times already listed are left as they are."""
        pipe = self.redis.pipeline(transaction=False)
        for shard, entry in entries.items():
            pipe.hsetnx(self.keys.checkpoint(checkpoint_id), str(shard), json.dumps(dict(entry)))
        pipe.zadd(self.keys.checkpoints(), {checkpoint_id: time.time()}, nx=True)
        pipe.execute()

    def forget_checkpoints(self, checkpoint_ids: Iterable[str]) -> None:
        """Lists checkpoints no more (retention removed them from disk), bad marks included."""
        ids = list(checkpoint_ids)
        if not ids:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(self.keys.checkpoints(), *ids)
        pipe.delete(*(self.keys.checkpoint(c) for c in ids))
        pipe.hdel(self.keys.bad(), *ids)
        pipe.execute()

    def mark_bad(self, checkpoint_id: str, reason: str, shard: int = -1) -> bool:
        """Records that checkpoint `checkpoint_id` failed verification (on `shard`, -1: not
        known): every scheduler and restarting server passes over it from then on. True when
        this call made the mark (the first reason is kept)."""
        return bool(self.redis.hsetnx(self.keys.bad(), checkpoint_id, json.dumps(
            {"reason": reason, "shard": shard, "time": time.time()})))

    def bad_checkpoints(self) -> dict[str, dict[str, Any]]:
        """Checkpoint id -> {reason, shard, time} of each checkpoint marked bad."""
        raw = self.redis.hgetall(self.keys.bad())
        return {_text(k): dict(json.loads(v)) for k, v in raw.items()}

    def stop_job(self, reason: str) -> None:
        """Records that the job cannot go on (no checkpoint verifies): `pstrain up` and the
        workers end on reading it."""
        self.redis.set(self.keys.stopped(), json.dumps({"reason": reason, "time": time.time()}))

    def stopped(self) -> str | None:
        """Why the job was stopped, or None while it may go on."""
        raw = self.redis.get(self.keys.stopped())
        return None if raw is None else str(json.loads(raw).get("reason", "stopped"))

    def checkpoint(self, checkpoint_id: str) -> dict[int, dict[str, Any]]:
        raw = self.redis.hgetall(self.keys.checkpoint(checkpoint_id))
        return {int(k): json.loads(v) for k, v in raw.items()}

    def checkpoint_ids(self) -> list[str]:
        """Checkpoint ids, newest first."""
        return [_text(c) for c in self.redis.zrevrange(self.keys.checkpoints(), 0, -1)]

    def complete(self, num_shards: int) -> Iterator[tuple[str, dict[int, dict[str, Any]]]]:
        """(id, entries) of each checkpoint every shard has written, newest first; one read
        per checkpoint listed, made as the caller asks for the next."""
        for checkpoint_id in self.checkpoint_ids():
            entries = self.checkpoint(checkpoint_id)
            if len(entries) == num_shards:
                yield checkpoint_id, entries

    def latest_checkpoint(self, num_shards: int) -> tuple[str, dict[int, dict[str, Any]]] | None:
        """The newest checkpoint that every shard has written, with its entries."""
        return next(self.complete(num_shards), None)

    def complete_checkpoints(self, num_shards: int) -> list[tuple[str, int]]:
        """(id, clock) of every checkpoint that every shard has written, newest listed first;
        the clock is the smallest its shards recorded."""
        return [(checkpoint_id, min(int(e.get("clock", 0)) for e in entries.values()))
                for checkpoint_id, entries in self.complete(num_shards)]


def new_run_id(started_s: float) -> str:
    """A run id: the start time (UTC, to the second) and 6 random hex digits, e.g.
    ``20261126-081500-3fa2c1``; sorts by start time and names a directory safely."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(started_s))
    return f"{stamp}-{os.urandom(3).hex()}"


def _event(eid: object, fields: object) -> Event:
    f = {_text(k): _text(v) for k, v in (fields or {}).items()}  # type: ignore[attr-defined]
    return Event(_text(eid), float(f["time"]), f["type"], f["role"], f["member"],
                 json.loads(f.get("detail", "{}")))


def _text(value: object) -> str:
    """A Redis reply as text (the client decodes replies; this narrows the type)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def ride_out(what: str, call: Callable[[], T], default: T) -> T:
    """Runs a Redis call; during an outage logs (once in a while) and returns `default`."""
    try:
        return call()
    except REDIS_DOWN as exc:
        now = time.monotonic()
        last = _last_warning.get(what, 0.0)
        if now - last > 10:
            _last_warning[what] = now
            log.warning("Redis unavailable (%s): %s; carrying on without it", what, exc)
        return default


_last_warning: dict[str, float] = {}
# Refusals by Redis logged once per process: what -> logged.
_warned: dict[str, bool] = {}

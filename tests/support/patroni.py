"""A real replicated PostgreSQL cluster for the failover tests: etcd plus Patroni nodes on loopback.

Debian's ``etcd-server`` (3.4) and ``patroni`` (3.0) packages, managing
PostgreSQL 15 from ``/usr/lib/postgresql/15/bin`` (``POSTGRES_MUTEX_TEST_HA_PG_BIN``
picks other binaries). Every process runs as the ``postgres`` OS user when
the suite runs as root (PostgreSQL refuses root), on 127.0.0.1 ports chosen
free at start, with everything under one temporary directory that is removed
at the end, whichever way the test ended.

    with PatroniCluster(nodes=2, synchronous=True) as cluster:
        dsn = cluster.dsn()               # every node, target_session_attrs=read-write
        cluster.switchover()              # Patroni's REST API; returns when a new leader runs
        killed = cluster.kill_leader()    # SIGKILL its Patroni and its PostgreSQL: a failover
        cluster.wait_leader(other_than=killed)
        cluster.restart_node(killed)      # rejoins as a replica (pg_rewind)
        cluster.wait_healthy()

Timings are short for loopback (``ttl`` 6 s, ``loop_wait`` 1 s,
``retry_timeout`` 2 s): a killed leader's key expires within ``ttl``, and the
survivor promotes itself at its next loop. Readiness is always polled with a
deadline, from PostgreSQL itself (``pg_is_in_recovery``, ``pg_stat_replication``)
and from Patroni's REST API, never assumed after a sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import psycopg

from tests.support.fixtures import required_tool, skip_or_fail_in_ci
from tests.support.pgbouncer import as_user, owned_tempdir, server_user
from tests.support.postgres_server import free_port

T = TypeVar("T")

PG_BIN_ENV = "POSTGRES_MUTEX_TEST_HA_PG_BIN"
DEFAULT_PG_BIN = "/usr/lib/postgresql/15/bin"

# Patroni's DCS timings, short for loopback. ttl bounds how long a dead
# leader's key survives it; loop_wait is how often each node acts.
TTL = 6
LOOP_WAIT = 1
RETRY_TIMEOUT = 2

START_TIMEOUT = 90.0
HEALTHY_TIMEOUT = 60.0


def ha_pg_bin() -> Path:
    """The PostgreSQL binaries Patroni manages; skip (fail in CI) when they are missing."""
    bin_dir = Path(os.environ.get(PG_BIN_ENV) or DEFAULT_PG_BIN)
    if not (bin_dir / "postgres").exists():
        skip_or_fail_in_ci(f"{bin_dir}/postgres not found: install Debian's postgresql-15 package or set {PG_BIN_ENV}")
    return bin_dir


def poll(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.1) -> T:
    """Call ``probe`` until it returns something other than None (or False); fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            found = probe()
        except (OSError, psycopg.Error, ValueError, KeyError) as exc:
            found, last_error = None, exc
        if found is not None and found is not False:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s (last error: {last_error!r})")
        time.sleep(interval)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, read from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            # The command name is in parentheses and may contain spaces: the ppid follows the last ')'.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, killed but not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


class Etcd:
    """A one-member etcd on loopback."""

    def __init__(self, root: Path, user: pwd.struct_passwd | None) -> None:
        self.binary = required_tool("etcd", "etcd-server")
        self.client_port, self.peer_port = free_port(), free_port()
        self.data = root / "etcd"
        self.log = root / "etcd.log"
        self._user = user
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(
                [
                    self.binary,
                    *("--name", "default", "--data-dir", str(self.data)),
                    *("--listen-client-urls", client, "--advertise-client-urls", client),
                    *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
                    *("--initial-cluster", f"default={peer}", "--log-level", "warn"),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                **as_user(self._user),  # type: ignore[call-overload]
            )
        poll("etcd healthy", self._healthy, START_TIMEOUT)

    def _healthy(self) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError(f"etcd exited: {self.log.read_text(errors='replace')[-2000:]}")
        with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=2) as reply:
            return bool(json.load(reply).get("health") == "true")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)


@dataclass
class Node:
    """One Patroni-managed PostgreSQL."""

    name: str
    port: int
    api_port: int
    root: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    stopped_pids: list[int] = field(default_factory=list)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def config(self) -> Path:
        return self.root / "patroni.yml"

    @property
    def log(self) -> Path:
        return self.root / "patroni.log"

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def dsn(self, **extra: str | int) -> str:
        params: dict[str, str | int] = {
            "host": "127.0.0.1",
            "port": self.port,
            "user": "postgres",
            "dbname": "postgres",
            "sslmode": "disable",
            "gssencmode": "disable",
            **extra,
        }
        return " ".join(f"{key}={value}" for key, value in params.items())

    @property
    def patroni_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def postmaster_pid(self) -> int | None:
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if _alive(pid) else None

    def log_tail(self, size: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-size:] if self.log.exists() else ""


class PatroniCluster:
    """etcd plus ``nodes`` Patroni nodes of PostgreSQL; a context manager.

    ``synchronous``: Patroni's ``synchronous_mode`` (one synchronous standby,
    ``synchronous_commit = on``: a commit returns once a standby has it, and
    Patroni fails over only to that standby); otherwise plain asynchronous
    streaming replication.
    """

    def __init__(self, *, nodes: int = 2, synchronous: bool = True, ttl: int = TTL) -> None:
        required_tool("patroni", "patroni")
        self.pg_bin = ha_pg_bin()
        self.synchronous = synchronous
        self.ttl = ttl
        self.scope = f"pgmutex-{uuid.uuid4().hex[:8]}"
        self._user = server_user()
        self.root = owned_tempdir("postgres-mutex-patroni-", self._user)
        self.etcd = Etcd(self.root, self._user)
        self.nodes = [Node(f"node{n}", free_port(), free_port(), self.root / f"node{n}") for n in range(nodes)]
        self.patroni = required_tool("patroni", "patroni")
        self.started_in: float | None = None

    # -- set-up ------------------------------------------------------------

    def _node_config(self, node: Node) -> dict[str, Any]:
        parameters = {
            "wal_level": "replica",
            "hot_standby": "on",
            "wal_log_hints": "on",  # pg_rewind of a demoted or killed leader
            "max_wal_senders": 10,
            "max_replication_slots": 10,
            "wal_keep_size": "128MB",
            "max_connections": 100,
            "synchronous_commit": "on",
            # Nothing here outlives the test; the OS keeps what a killed process wrote.
            "fsync": "off",
            "full_page_writes": "on",
            "shared_buffers": "32MB",
            "wal_receiver_status_interval": "1s",
            "wal_retrieve_retry_interval": "500ms",
        }
        return {
            "scope": self.scope,
            "namespace": "/postgres-mutex-tests/",
            "name": node.name,
            "log": {"level": "INFO", "format": "%(asctime)s %(levelname)s: %(message)s"},
            "restapi": {"listen": f"127.0.0.1:{node.api_port}", "connect_address": f"127.0.0.1:{node.api_port}"},
            "etcd3": {"hosts": [self.etcd.endpoint]},
            "bootstrap": {
                "dcs": {
                    "ttl": self.ttl,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 16 * 1024 * 1024,
                    "synchronous_mode": self.synchronous,
                    "synchronous_mode_strict": False,
                    "postgresql": {"use_pg_rewind": True, "use_slots": True, "parameters": parameters},
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}, "no-sync"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.port}",
                "connect_address": f"127.0.0.1:{node.port}",
                "data_dir": str(node.data),
                "bin_dir": str(self.pg_bin),
                "pgpass": str(node.root / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres"},
                    "replication": {"username": "postgres"},
                    "rewind": {"username": "postgres"},
                },
                "parameters": {"unix_socket_directories": str(node.root)},
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
        }

    def start(self) -> None:
        started = time.monotonic()
        self.etcd.start()
        for node in self.nodes:
            node.root.mkdir()
            if self._user is not None:
                os.chown(node.root, self._user.pw_uid, self._user.pw_gid)
            node.root.chmod(0o700)
            # JSON is YAML: no YAML writer needed.
            node.config.write_text(json.dumps(self._node_config(node), indent=2))
            self.start_node(node)
            if node is self.nodes[0]:
                # The first node bootstraps alone; the others clone from it.
                self.wait_leader(timeout=START_TIMEOUT)
        self.wait_healthy(timeout=START_TIMEOUT)
        self.started_in = time.monotonic() - started

    def start_node(self, node: Node) -> None:
        assert not node.patroni_running, f"{node.name} already runs"
        with open(node.log, "ab") as log:
            node.proc = subprocess.Popen(
                [self.patroni, str(node.config)],
                cwd=node.root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8", "PGTZ": "UTC"},
                **as_user(self._user),  # type: ignore[call-overload]
            )
        node.starts += 1

    # -- what the cluster looks like -----------------------------------------

    def node(self, name: str) -> Node:
        return next(node for node in self.nodes if node.name == name)

    def patroni_view(self) -> dict[str, Any]:
        """Patroni's GET /cluster from the first node whose REST API answers."""
        last: BaseException | None = None
        for node in self.nodes:
            if not node.patroni_running:
                continue
            try:
                with urllib.request.urlopen(f"{node.api}/cluster", timeout=2) as reply:
                    view: dict[str, Any] = json.load(reply)
                    return view
            except (OSError, ValueError) as exc:
                last = exc
        raise OSError(f"no Patroni REST API answers: {last!r}")

    def roles(self) -> dict[str, str]:
        """Patroni's role of each member it knows: leader, sync_standby or replica."""
        return {member["name"]: member["role"] for member in self.patroni_view()["members"]}

    def primary(self) -> Node | None:
        """The node whose PostgreSQL accepts writes now (asked directly), if exactly one does.

        Out of recovery is not yet writable: a node just promoted can still
        start its sessions read-only (``default_transaction_read_only``) for a
        moment, and a client's statements there fail with "read-only
        transaction". A new session must find ``transaction_read_only`` off.
        """
        writable = []
        for node in self.nodes:
            with contextlib.suppress(psycopg.Error), psycopg.connect(node.dsn(connect_timeout=2)) as conn:
                found = conn.execute("SELECT pg_is_in_recovery(), current_setting('transaction_read_only')").fetchone()
                if found is not None and found[0] is False and found[1] == "off":
                    writable.append(node)
        return writable[0] if len(writable) == 1 else None

    def leader(self) -> Node:
        """The leader as Patroni and PostgreSQL both see it; raises if they disagree or there is none."""
        leaders = [name for name, role in self.roles().items() if role == "leader"]
        primary = self.primary()
        if len(leaders) != 1 or primary is None or primary.name != leaders[0]:
            raise ValueError(f"no agreed leader: Patroni says {leaders}, PostgreSQL says {primary}")
        return primary

    def wait_leader(self, *, other_than: Node | None = None, timeout: float = HEALTHY_TIMEOUT) -> Node:
        """Wait until one node leads (and it is not ``other_than``); return it."""

        def probe() -> Node | None:
            leader = self.leader()
            return None if other_than is not None and leader.name == other_than.name else leader

        return poll("a leader", probe, timeout)

    def replication(self, leader: Node) -> list[tuple[str, str, str]]:
        """(standby name, state, sync_state) of each standby connected to ``leader``."""
        with psycopg.connect(leader.dsn(connect_timeout=2)) as conn:
            rows = conn.execute("SELECT application_name, state, sync_state FROM pg_stat_replication").fetchall()
        return [(str(name), str(state), str(sync)) for name, state, sync in rows]

    def healthy(self) -> Node | None:
        """The leader, if every node runs, every standby streams from it, and (synchronous) one is sync."""
        leader = self.leader()
        standbys = {name: (state, sync) for name, state, sync in self.replication(leader)}
        others = [node.name for node in self.nodes if node.name != leader.name]
        if any(standbys.get(name, ("", ""))[0] != "streaming" for name in others):
            return None
        with psycopg.connect(leader.dsn(connect_timeout=2)) as conn:
            found = conn.execute("SHOW synchronous_standby_names").fetchone()
        if bool(found and found[0]) != self.synchronous:
            return None  # Patroni has not applied the replication mode yet
        if self.synchronous:
            roles = self.roles()
            if not any(sync == "sync" and roles.get(name) == "sync_standby" for name, (_, sync) in standbys.items()):
                return None
        return leader

    def wait_healthy(self, timeout: float = HEALTHY_TIMEOUT) -> Node:
        """Wait until `healthy`; restarts nothing (see `restart_node`)."""
        try:
            return poll("a healthy cluster", self.healthy, timeout, interval=0.2)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.describe()}") from None

    def sync_standby(self) -> Node:
        """The node Patroni lists as synchronous standby (synchronous mode only)."""
        names = [name for name, role in self.roles().items() if role == "sync_standby"]
        if len(names) != 1:
            raise ValueError(f"no single sync standby: {self.roles()}")
        return self.node(names[0])

    def describe(self) -> str:
        """What each node is doing, for failure messages."""
        lines = []
        with contextlib.suppress(OSError, ValueError):
            lines.append(json.dumps(self.patroni_view()))
        for node in self.nodes:
            lines.append(f"--- {node.name} (patroni running: {node.patroni_running}) ---\n{node.log_tail(1500)}")
        return "\n".join(lines)

    def set_synchronous(self, synchronous: bool, timeout: float = HEALTHY_TIMEOUT) -> Node:
        """Switch Patroni's ``synchronous_mode`` (PATCH /config); return the leader once it is applied."""
        if synchronous != self.synchronous:
            leader = self.wait_healthy(timeout)
            body = json.dumps({"synchronous_mode": synchronous}).encode()
            request = urllib.request.Request(
                f"{leader.api}/config", data=body, method="PATCH", headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=10) as reply:
                assert reply.status == 200, reply.read()
            self.synchronous = synchronous
        return self.wait_healthy(timeout)

    # -- connecting --------------------------------------------------------

    def dsn(self, *, target_session_attrs: str = "read-write", **extra: str | int) -> str:
        """A multi-host DSN listing every node; libpq picks the one that matches ``target_session_attrs``."""
        params: dict[str, str | int] = {
            "host": ",".join("127.0.0.1" for _ in self.nodes),
            "port": ",".join(str(node.port) for node in self.nodes),
            "user": "postgres",
            "dbname": "postgres",
            "target_session_attrs": target_session_attrs,
            "sslmode": "disable",
            "gssencmode": "disable",
            **extra,
        }
        return " ".join(f"{key}={value}" for key, value in params.items())

    # -- faults ------------------------------------------------------------

    def switchover(self, candidate: Node | None = None, timeout: float = HEALTHY_TIMEOUT) -> Node:
        """A planned switchover through Patroni's REST API; returns the new leader once it takes writes."""
        leader = self.leader()
        if candidate is None:
            candidate = self.sync_standby() if self.synchronous else next(n for n in self.nodes if n is not leader)
        body = json.dumps({"leader": leader.name, "candidate": candidate.name}).encode()

        def ask() -> bool:
            request = urllib.request.Request(
                f"{leader.api}/switchover", data=body, method="POST", headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=timeout) as reply:
                    return bool(reply.status == 200)
            except urllib.error.HTTPError as exc:
                # 412/503: the candidate is not ready yet (still catching up after the last fault).
                if exc.code in (412, 503):
                    return False
                raise

        poll("Patroni accepts the switchover", ask, timeout, interval=0.5)
        return self.wait_leader(other_than=leader, timeout=timeout)

    def kill_node(self, node: Node) -> None:
        """SIGKILL the node's Patroni and its PostgreSQL (postmaster and every backend): a crashed machine."""
        postmaster = node.postmaster_pid()
        if node.proc is not None:
            node.proc.kill()
        pids = [postmaster, *_children(postmaster)] if postmaster is not None else []
        for pid in pids:
            _kill(pid)
        if node.proc is not None:
            node.proc.wait(10)
        poll(f"{node.name}'s processes gone", lambda: not any(_alive(pid) for pid in pids), 15)
        node.stopped_pids.extend(pids)

    def kill_leader(self) -> Node:
        """A failover: kill the current leader's Patroni and PostgreSQL; return the killed node."""
        leader = self.leader()
        self.kill_node(leader)
        return leader

    def restart_node(self, node: Node) -> None:
        """Start a killed node's Patroni again; it rejoins as a replica of the current leader."""
        if not node.patroni_running:
            self.start_node(node)

    def heal(self, timeout: float = HEALTHY_TIMEOUT) -> Node:
        """Restart whatever was killed and wait until the cluster is healthy again; return the leader."""
        for node in self.nodes:
            self.restart_node(node)
        return self.wait_healthy(timeout)

    @contextlib.contextmanager
    def replication_paused(self, leader: Node) -> Iterator[None]:
        """Freeze the leader's WAL senders (SIGSTOP): no standby receives anything until the block ends.

        Asynchronous replication lagging at the worst moment, made
        deterministic: a commit made now exists on the leader only. Killing
        the leader inside the block loses it for good.
        """
        postmaster = leader.postmaster_pid()
        assert postmaster is not None, f"{leader.name} runs no PostgreSQL"
        senders = [pid for pid in _children(postmaster) if b"walsender" in _cmdline(pid)]
        assert senders, f"{leader.name} has no WAL sender"
        for pid in senders:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in senders:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    # -- tear-down ---------------------------------------------------------

    def close(self) -> None:
        """Kill every process (Patroni, PostgreSQL, etcd) and remove every file."""
        try:
            for node in self.nodes:
                with contextlib.suppress(Exception):
                    self.kill_node(node)
        finally:
            self.etcd.stop()
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PatroniCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""

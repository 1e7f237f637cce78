"""A PostgreSQL primary and its standby on loopback, for tests of a failover.

:class:`PostgresPair` builds both servers in a directory of its own with the server programs
of this machine (``initdb``, ``pg_basebackup``, ``pg_ctl`` from
``/usr/lib/postgresql/<version>/bin`` or ``$PATH``), on free loopback ports (never 5432)::

    with PostgresPair() as pair:             # primary + synchronous standby, both running
        storage = PostgresStorage(pair.url)  # host=h,h port=P1,P2 target_session_attrs=read-write
        ...
        failover = pair.fail_over()          # SIGKILL the primary, promote the standby
        print(failover.seconds_to_first_commit)

The standby is made by ``pg_basebackup -R`` and streams from the primary; with
``synchronous=True`` (the default) the primary names it in ``synchronous_standby_names``
and runs ``synchronous_commit = on``: a commit returns once the standby has flushed it, so
a failover loses no acknowledged commit. ``synchronous=False`` is the honest counterpart:
no synchronous standby and ``synchronous_commit = off``, so a commit returns before even
the primary's WAL reached its disk, and a failover loses the last ones.

:meth:`~PostgresPair.fail_over` kills the primary's whole process group (the server and
its backends, as a lost machine) and promotes the standby with ``pg_ctl promote``; the
promoted server runs without a synchronous standby (it has none left). The old primary
stays down, or comes back as the new standby after ``pg_rewind``
(:meth:`~PostgresPair.rejoin`).

Started as root (as in a container), the servers run as the ``postgres`` operating-system
user (``runuser``), in directories it owns. Every wait is on a condition (``pg_isready``,
a query) with a generous deadline; :meth:`~PostgresPair.stop` stops both servers and
deletes the directory.

Run ``python -m idembus.testing.pg_cluster`` to start a pair, fail it over once and print
the times measured.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from .processes import alive

#: The OS user the servers run as when this process is root (PostgreSQL refuses root).
SERVER_USER = "postgres"
#: The standby's name, in ``synchronous_standby_names`` and its ``application_name``.
STANDBY_NAME = "standby"
#: Settings both servers start with: small, for a shared 2-core machine.
_COMMON_SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "shared_buffers": "'16MB'",
    "max_connections": "60",
    "wal_level": "replica",
    "max_wal_senders": "4",
    "wal_keep_size": "'64MB'",
    "wal_log_hints": "on",  # pg_rewind needs it
    "hot_standby": "on",
    "fsync": "on",
    "logging_collector": "off",
}


class ClusterError(RuntimeError):
    """A server program failed, or a server did not reach the state waited for in time."""


@dataclasses.dataclass(frozen=True)
class Failover:
    """What one failover took, in seconds from the moment the primary was killed."""

    #: Until ``pg_ctl promote`` returned (the standby accepts writes).
    seconds_to_promoted: float
    #: Until a commit on the promoted standby, through the multi-host conninfo, returned.
    seconds_to_first_commit: float


def server_programs() -> Path:
    """The directory of this machine's newest PostgreSQL server programs."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda path: int(Path(path).parent.parent.name or 0))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb is None:
        raise ClusterError("initdb not found (install the PostgreSQL server, e.g. the "
                           "postgresql package)")
    return Path(initdb).parent


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free at the time of asking."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclasses.dataclass
class _Server:
    name: str
    port: int
    data: Path

    @property
    def conninfo(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres"


class PostgresPair:
    """A primary and a standby (see the module docstring).

    Parameters
    ----------
    synchronous:
        The standby is synchronous and commits wait for it (``True``), or asynchronous
        with ``synchronous_commit = off`` on the primary (``False``).
    database:
        The database created on the primary (and so on the standby).
    root:
        The directory to build both servers in (a new temporary one by default; deleted by
        :meth:`stop` either way).
    timeout:
        Seconds to wait for each step (a server up, the standby streaming, a promotion).
    """

    def __init__(self, *, synchronous: bool = True, database: str = "idembus",
                 root: Path | None = None, timeout: float = 60.0) -> None:
        self.synchronous = synchronous
        self.database = database
        self.timeout = timeout
        self._root = Path(root) if root is not None else Path(
            tempfile.mkdtemp(prefix="idembus-pg-"))
        self._bin = server_programs()
        self._as_root = os.geteuid() == 0
        first, second = free_ports(2)
        self._servers = [_Server("primary", first, self._root / "primary"),
                         _Server(STANDBY_NAME, second, self._root / STANDBY_NAME)]
        self._primary, self._standby = self._servers
        self._running: set[str] = set()
        #: Failovers done so far.
        self.failovers = 0

    # -- addresses --------------------------------------------------------------------

    @property
    def ports(self) -> tuple[int, int]:
        """The primary's port at start, then the standby's."""
        return (self._servers[0].port, self._servers[1].port)

    @property
    def url(self) -> str:
        """A multi-host URL of the pair that connects to whichever is the primary."""
        first, second = self.ports
        return (f"postgresql://postgres@127.0.0.1:{first},127.0.0.1:{second}/{self.database}"
                "?target_session_attrs=read-write&connect_timeout=2")

    @property
    def primary_url(self) -> str:
        """A URL of the server that is the primary now."""
        return self.url_of(self._primary)

    def url_of(self, server: _Server) -> str:
        return f"postgresql://postgres@127.0.0.1:{server.port}/{self.database}"

    @property
    def primary_port(self) -> int:
        """The port of the server that is the primary now."""
        return self._primary.port

    # -- life cycle -------------------------------------------------------------------

    def __enter__(self) -> PostgresPair:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Create and start the primary, create the database, clone the standby and wait
        until it streams (as a synchronous standby when ``synchronous``)."""
        try:
            self._prepare_root()
            self._initdb(self._primary)
            self._start(self._primary)
            self._psql(self._primary, f'CREATE DATABASE "{self.database}"', database="postgres")
            self._clone(self._standby, source=self._primary)
            self._start(self._standby)
            self._name_synchronous_standby()
            self.wait_streaming()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop both servers (fast shutdown; killed if that fails) and delete the directory."""
        for server in self._servers:
            if server.name in self._running:
                try:
                    self._ctl(server, "stop", "-m", "fast", "-t", str(int(self.timeout)))
                except ClusterError:
                    self._kill(server)
                self._running.discard(server.name)
        # a killed server's backends may outlive it for a moment
        for server in self._servers:
            self._kill(server, quiet=True)
        shutil.rmtree(self._root, ignore_errors=True)

    def fail_over(self, *, probe: Callable[[], Any] | None = None) -> Failover:
        """SIGKILL the primary (its server and backends), promote the standby, and wait
        until a commit through :attr:`url` lands on it (or ``probe`` returns)."""
        old, new = self._primary, self._standby
        killed = time.monotonic()
        self._kill(old)
        self._running.discard(old.name)
        self._ctl(new, "promote", "-w", "-t", str(int(self.timeout)))
        promoted = time.monotonic() - killed
        self._primary, self._standby = new, old
        self.failovers += 1
        self._wait(lambda: self._first_commit(probe), "a commit on the promoted standby")
        return Failover(seconds_to_promoted=promoted,
                        seconds_to_first_commit=time.monotonic() - killed)

    def rejoin(self) -> None:
        """Bring the old primary back as the standby of the new one (``pg_rewind`` first:
        it may hold WAL the new primary never had) and wait until it streams."""
        old = self._standby
        if old.name in self._running:
            raise ClusterError(f"{old.name} is running: fail over first")
        pid = _postmaster_pid(old.data)
        if pid is not None and not alive(pid):
            # killed, perhaps not reaped yet: PostgreSQL would take the zombie for a
            # server still running in that directory
            (old.data / "postmaster.pid").unlink()
        # the promoted server's control file names its new timeline only after a
        # checkpoint; until then pg_rewind finds "no rewind required"
        self._psql(self._primary, "CHECKPOINT")
        self._run([str(self._bin / "pg_rewind"), "-D", str(old.data),
                   "--source-server", f"{self._primary.conninfo} dbname=postgres", "-R"],
                  as_server=True)
        self._configure_standby(old, self._primary)
        self._start(old)
        self._name_synchronous_standby()
        self.wait_streaming()

    def _name_synchronous_standby(self) -> None:
        """Make the standby the primary's synchronous one (when ``synchronous``), once it
        streams: from then on each commit waits for it."""
        if not self.synchronous:
            return
        self._wait(lambda: self._psql(self._primary, self._streaming, check=False) != "",
                   f"{self._standby.name} streaming")
        self._psql(self._primary, "ALTER SYSTEM SET synchronous_standby_names = "
                   f"'{self._standby.name}'")
        self._psql(self._primary, "SELECT pg_reload_conf()")

    @property
    def _streaming(self) -> str:
        return ("SELECT sync_state FROM pg_stat_replication "
                f"WHERE application_name = '{self._standby.name}' AND state = 'streaming'")

    def wait_streaming(self) -> None:
        """Wait until the primary sends WAL to the standby (as a synchronous standby when
        ``synchronous``)."""
        wanted = "sync" if self.synchronous else "async"
        self._wait(lambda: self._psql(self._primary, self._streaming, check=False) == wanted,
                   f"{self._standby.name} streaming as a {wanted} standby")

    def kill_primary(self) -> None:
        """SIGKILL the primary without promoting anything (an outage with no failover)."""
        self._kill(self._primary)
        self._running.discard(self._primary.name)

    # -- steps ------------------------------------------------------------------------

    def _prepare_root(self) -> None:
        self._root.mkdir(parents=True, exist_ok=True)
        os.chmod(self._root, 0o700)
        if self._as_root:
            account = pwd.getpwnam(SERVER_USER)
            os.chown(self._root, account.pw_uid, account.pw_gid)

    def _initdb(self, server: _Server) -> None:
        self._run([str(self._bin / "initdb"), "-D", str(server.data), "-U", "postgres",
                   "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C"], as_server=True)
        settings = dict(_COMMON_SETTINGS)
        settings["unix_socket_directories"] = f"'{self._root}'"
        # the standby is named once it streams: until then every commit would wait for it
        settings["synchronous_standby_names"] = "''"
        settings["synchronous_commit"] = "on" if self.synchronous else "off"
        self._append(server.data / "postgresql.conf", settings)

    def _clone(self, server: _Server, *, source: _Server) -> None:
        self._run([str(self._bin / "pg_basebackup"), "-D", str(server.data), "-R",
                   "-X", "stream", "-c", "fast", "-d", source.conninfo], as_server=True)
        self._configure_standby(server, source)

    def _configure_standby(self, server: _Server, source: _Server) -> None:
        """``server`` follows ``source`` under its own name, and wants no synchronous
        standby of its own (once promoted it has none: its commits must not wait)."""
        self._append(server.data / "postgresql.auto.conf", {
            "primary_conninfo": f"'{source.conninfo} application_name={server.name}'",
            "synchronous_standby_names": "''",
        })
        (server.data / "standby.signal").touch()
        if self._as_root:
            account = pwd.getpwnam(SERVER_USER)
            os.chown(server.data / "standby.signal", account.pw_uid, account.pw_gid)

    def _start(self, server: _Server) -> None:
        self._ctl(server, "start", "-w", "-t", str(int(self.timeout)),
                  "-l", str(self._root / f"{server.name}.log"), "-o", f"-p {server.port}")
        self._running.add(server.name)
        self._wait(lambda: self._run([str(self._bin / "pg_isready"), "-q", "-h", "127.0.0.1",
                                      "-p", str(server.port)], check=False) == 0,
                   f"{server.name} accepting connections")

    def _first_commit(self, probe: Callable[[], Any] | None) -> bool:
        if probe is not None:
            try:
                probe()
            except Exception:
                return False
            return True
        import psycopg  # the extra idembus[postgres]; only here for the default probe

        try:
            with psycopg.connect(self.url, autocommit=True) as connection:
                connection.execute("CREATE TEMPORARY TABLE failover_probe (x int)")
                connection.execute("INSERT INTO failover_probe VALUES (1)")
        except psycopg.Error:
            return False
        return True

    # -- processes --------------------------------------------------------------------

    def _ctl(self, server: _Server, *args: str) -> None:
        self._run([str(self._bin / "pg_ctl"), "-D", str(server.data), *args], as_server=True)

    def _psql(self, server: _Server, sql: str, *, database: str | None = None,
              check: bool = True) -> str:
        result = subprocess.run(
            self._command([str(self._bin / "psql"), "-X", "-A", "-t", "-q", "-v",
                           "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p", str(server.port),
                           "-U", "postgres", "-d", database or self.database, "-c", sql],
                          as_server=True),
            capture_output=True, text=True, timeout=self.timeout, check=False)
        if check and result.returncode != 0:
            raise ClusterError(f"psql on {server.name} failed: {result.stderr.strip()}")
        return result.stdout.strip()

    def _run(self, command: Sequence[str], *, as_server: bool = False,
             check: bool = True) -> int:
        result = subprocess.run(self._command(command, as_server=as_server),
                                capture_output=True, text=True, timeout=self.timeout * 2,
                                check=False, cwd=self._root)
        if check and result.returncode != 0:
            raise ClusterError(f"{Path(command[0]).name} failed ({result.returncode}): "
                               f"{(result.stderr or result.stdout).strip()}")
        return result.returncode

    def _command(self, command: Sequence[str], *, as_server: bool) -> list[str]:
        if as_server and self._as_root:
            return ["runuser", "-u", SERVER_USER, "--", *command]
        return list(command)

    def _kill(self, server: _Server, *, quiet: bool = False) -> None:
        """SIGKILL ``server``'s process group (``pg_ctl`` starts the server as the leader
        of a session of its own: its backends share the group)."""
        pid = _postmaster_pid(server.data)
        if pid is None:
            return
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except PermissionError:
            if quiet:
                return
            raise
        self._wait(lambda: not alive(pid), f"{server.name} gone")

    def _wait(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        pause = 0.02
        while not condition():
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {self.timeout:.0f} s waiting for {what}")
            time.sleep(pause)
            pause = min(pause * 2, 0.25)

    @staticmethod
    def _append(path: Path, settings: dict[str, str]) -> None:
        with path.open("a", encoding="utf-8") as config:
            config.write("".join(f"{name} = {value}\n" for name, value in settings.items()))


def _postmaster_pid(data: Path) -> int | None:
    try:
        first = (data / "postmaster.pid").read_text(encoding="utf-8").split("\n", 1)[0]
    except (OSError, UnicodeDecodeError):
        return None
    return int(first) if first.strip().isdigit() else None


def main() -> None:
    """Start a synchronous pair, fail it over once, print the times, stop it."""
    with PostgresPair() as pair:
        print(f"pair up: {pair.url}", flush=True)
        failover = pair.fail_over()
        print(f"promoted after {failover.seconds_to_promoted:.2f} s; first commit after "
              f"{failover.seconds_to_first_commit:.2f} s", flush=True)


if __name__ == "__main__":
    main()

"""A TCP forwarder a test can cut and restore: a broker outage for the clients that connect
through it, without disturbing anybody else's connections to the broker.

    with TcpProxy("127.0.0.1", 5672) as proxy:
        url = f"amqp://guest:guest@127.0.0.1:{proxy.port}//"
        ...
        proxy.cut()       # every connection through it is reset, new ones are refused
        proxy.restore()   # connections are accepted again
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType


class TcpProxy:
    """Forwards connections on a free local port to ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port: int = probe.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None

    def restore(self) -> None:
        """Accept connections (again)."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        """Reset every forwarded connection and refuse new ones until :meth:`restore`."""
        if self._listener is not None:
            _shut(self._listener)  # wakes the thread blocked in accept()
            self._listener = None
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for connection in sockets:
            _shut(connection)

    def __enter__(self) -> TcpProxy:
        self.restore()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.cut()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _shut(client)
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        _shut(source)
        _shut(sink)


def _shut(connection: socket.socket) -> None:
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    connection.close()

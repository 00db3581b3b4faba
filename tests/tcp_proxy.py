"""A real TCP proxy for tests: a thread between a client and a database server that can
slow down new connections, leave them unanswered, silently stop forwarding (a proxy or NAT
dropping a connection without a reset), reset every connection at once, or cut a connection as
a statement goes out on it."""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time

from .conftest import wait_for


class BlackHoleProxy:
    """Forwards TCP to ``target``; :meth:`black_hole` stops forwarding every connection that
    has sent a ``LISTEN``, in both directions, without closing anything."""

    def __init__(
        self, target: tuple[str, int], handshake_delay: float = 0.0, port: int = 0
    ) -> None:
        self.target = target
        #: Seconds each new connection waits before it reaches the server (a slow network
        #: or a busy server at connect time).
        self.handshake_delay = handshake_delay
        #: ``port`` 0: a free one; another: that one (a server that comes up where clients
        #: were refused until now).
        self.server = socket.create_server(("127.0.0.1", port))
        self.port = self.server.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.server, selectors.EVENT_READ)
        self._peers: dict[socket.socket, socket.socket] = {}
        self._listening: set[socket.socket] = set()
        self._clients: set[socket.socket] = set()
        self._holed: list[socket.socket] = []
        self._hole = threading.Event()
        self._reset = threading.Event()
        self._reset_count = 0
        self._cut = threading.Event()
        #: While set, new connections are accepted and then left unanswered (a server or
        #: network that does not answer a connect); :meth:`let_held_through` forwards them.
        self.hold_new = threading.Event()
        self._let_through = threading.Event()
        self.held: list[socket.socket] = []
        #: Connections cut by :meth:`cut_next_send`, with what their client had sent.
        self.cut: list[bytes] = []
        self._stop = threading.Event()
        self.connections = 0
        self._thread = threading.Thread(target=self._run, name="test-proxy", daemon=True)
        self._thread.start()

    def black_hole(self) -> int:
        """Stop forwarding the LISTEN connections open now; return how many."""
        self._hole.set()
        wait_for(lambda: not self._hole.is_set())
        return len(self._holed) // 2

    def reset_all(self) -> int:
        """Reset every forwarded connection open now, both ways (an abortive close: the
        client and the server each see the connection reset, as when a firewall or a NAT
        drops it and answers with RST); return how many. The black-holed ones stay as they
        are."""
        self._reset.set()
        wait_for(lambda: not self._reset.is_set())
        return self._reset_count

    def let_held_through(self) -> None:
        """Stop holding new connections and forward the held ones from now on (what their
        clients sent meanwhile reaches the server)."""
        self.hold_new.clear()
        self._let_through.set()
        wait_for(lambda: not self._let_through.is_set())

    def _connect_upstream(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            # The server is down: the client sees its connection closed, as without a proxy
            # it would see the connect refused.
            client.close()
            return
        self._peers[client], self._peers[upstream] = upstream, client
        self._clients.add(client)
        self._sel.register(client, selectors.EVENT_READ)
        self._sel.register(upstream, selectors.EVENT_READ)
        self.connections += 1

    def open_connections(self) -> int:
        """Forwarded connections whose client has not closed them yet."""
        return sum(1 for client in list(self._clients) if client.fileno() != -1)

    def cut_next_send(self) -> None:
        """The next bytes any client sends are dropped, and its connection closed in both
        directions: the server never sees them, the client sees the connection die while it
        waits for the answer."""
        self._cut.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._hole.is_set():
                for client in list(self._listening):
                    for sock in (client, self._peers[client]):
                        self._sel.unregister(sock)
                        self._holed.append(sock)
                    self._listening.discard(client)
                self._hole.clear()
            if self._reset.is_set():
                self._reset_count = 0
                for client in list(self._clients):
                    if client.fileno() == -1 or client in self._holed:
                        continue
                    self._reset_count += 1
                    for sock in (client, self._peers[client]):
                        self._sel.unregister(sock)
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                        sock.close()
                    self._listening.discard(client)
                    self._clients.discard(client)
                self._reset.clear()
            if self._let_through.is_set():
                held, self.held = self.held, []
                for client in held:
                    self._connect_upstream(client)
                self._let_through.clear()
            for key, _ in self._sel.select(0.02):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock.fileno() == -1:  # closed with its peer earlier in this round
                    continue
                if sock is self.server:
                    client, _ = self.server.accept()
                    if self.hold_new.is_set():
                        self.held.append(client)
                        continue
                    if self.handshake_delay:
                        time.sleep(self.handshake_delay)  # the delay is what is simulated
                    self._connect_upstream(client)
                    continue
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                peer = self._peers[sock]
                if not data:
                    for s in (sock, peer):
                        self._sel.unregister(s)
                        s.close()
                    self._listening.discard(sock)
                    self._listening.discard(peer)
                    continue
                if sock in self._clients and self._cut.is_set():
                    # Recorded before the close, which the client may see at once.
                    self.cut.append(data)
                    self._cut.clear()
                    for s in (sock, peer):
                        self._sel.unregister(s)
                        s.close()
                    continue
                if sock in self._clients and b"LISTEN" in data:
                    self._listening.add(sock)
                peer.sendall(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in [*self._peers, *self._holed, *self.held, self.server]:
            try:
                sock.close()
            except OSError:
                pass
        self._sel.close()

"""A local TCP port nobody listens on now, for the benchmarks' process groups: a fixed port
collides with another job's run on the same machine (or an earlier run's store not yet gone)."""
import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

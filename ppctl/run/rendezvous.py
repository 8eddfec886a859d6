"""An explicit rendezvous endpoint (``launcher.rdzv_endpoint``), checked before torchrun starts.

A single-node run without an endpoint hosts its own rendezvous on a port the OS picks (see
``ppctl.run.launch``); an endpoint that is set must work: its host must resolve, a single-node run's
port must be free on this machine, and whatever listens there must answer as a torch rendezvous.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import threading
import time

from ppctl.config import LauncherConfig, parse_endpoint

CONNECT_S = 5.0  # the longest wait for a TCP connection to an explicit rendezvous endpoint
RESOLVE_S = 5.0  # the longest wait for its host's address

# Run in a child process: a TCP store client waits for its handshake without a time limit, so the
# child is what the time limit ends.
_STORE_PROBE = ("import datetime, sys\n"
                "from torch.distributed import TCPStore\n"
                "TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, "
                "timeout=datetime.timedelta(seconds=float(sys.argv[3])))\n")


def rendezvous_problem(launcher: LauncherConfig) -> str | None:
    """Why ``launcher.rdzv_endpoint`` cannot work, in one line (None when it may, or when none is set).

    Its host must resolve (within ``RESOLVE_S``: torchrun would retry for minutes). A single-node run
    hosts the rendezvous itself, so its port must be free on this machine (torchrun would otherwise
    join whatever store holds it). Any other run connects there: a program that accepts the
    connection but never answers as a rendezvous would hang torchrun, so it must answer as one
    within ``launcher.timeout_s``. Nothing listening yet is fine: the other nodes may start later,
    and torchrun waits for them.
    """
    endpoint = launcher.rdzv_endpoint
    if not endpoint:
        return None
    host, port = parse_endpoint(endpoint)
    setting = f"launcher.rdzv_endpoint={endpoint}"
    unresolved = resolve_failure(host, min(RESOLVE_S, launcher.timeout_s))
    if unresolved is not None:
        return (f"{setting}: host {host} does not resolve ({unresolved}); set the name or address of the node "
                f"that hosts the rendezvous, one that every node can resolve")
    if launcher.nnodes == 1 and is_local_host(host):
        return local_port_problem(setting, port)
    return remote_endpoint_problem(setting, host, port, launcher.timeout_s)


def resolve_failure(host: str, timeout_s: float) -> str | None:
    """Why ``host`` does not resolve within ``timeout_s`` (the resolver's reason), or None when it does."""
    outcome: list[str | None] = []

    def look_up() -> None:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            outcome.append(None)
        except OSError as error:
            outcome.append(error.strerror or str(error))

    # getaddrinfo takes no time limit: the wait is bounded here, and a lookup still hanging is left behind.
    lookup = threading.Thread(target=look_up, daemon=True)
    lookup.start()
    lookup.join(timeout_s)
    return outcome[0] if outcome else f"no answer from the resolver within {timeout_s:g} s"


def local_port_problem(setting: str, port: int) -> str | None:
    """Why a single-node run cannot host its rendezvous on ``port`` of this machine (one line), or None."""
    if port != 0 and port_in_use(port):
        return (f"{setting}: port {port} is already in use on this machine (another run's rendezvous, or "
                f"another program); a single-node run hosts its rendezvous there: choose a free port, or leave "
                f"launcher.rdzv_endpoint unset (each run then gets a free port of its own)")
    return None


def remote_endpoint_problem(setting: str, host: str, port: int, timeout_s: float) -> str | None:
    """Why the rendezvous at ``host:port`` cannot work (one line), or None: something there that accepts
    connections must answer as a torch rendezvous within ``timeout_s``; nothing there yet is fine."""
    deadline = time.monotonic() + timeout_s
    if port == 0 or not accepts_connections(host, port, min(CONNECT_S, timeout_s)):
        return None
    if answers_as_store(host, port, max(0.1, deadline - time.monotonic())):
        return None
    return (f"{setting}: something accepts connections there but does not answer as a torch rendezvous within "
            f"launcher.timeout_s={timeout_s} s; check the host and port (another program may hold it)")


def is_local_host(host: str) -> bool:
    """Whether ``host`` names an address of this machine (one a socket can be bound to here)."""
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, _, _, address in addresses:
        with socket.socket(family, kind) as probe:
            try:
                probe.bind((address[0], 0, *address[2:]))
                return True
            except OSError:
                continue
    return False


def port_in_use(port: int) -> bool:
    """Whether a TCP port is taken on this machine: bound on every address, as torch's store server binds it."""
    for family, wildcard in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here: the IPv4 wildcard decides
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store: TIME_WAIT is no owner
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                probe.bind((wildcard, port))
                return False
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return True
    return False


def accepts_connections(host: str, port: int, timeout_s: float) -> bool:
    """Whether something at ``host:port`` accepts a TCP connection within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def answers_as_store(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` answers a torch TCP store client's handshake within ``timeout_s`` (a child process)."""
    command = [sys.executable, "-c", _STORE_PROBE, host, str(port), f"{timeout_s:g}"]
    try:
        probe = subprocess.run(command, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0

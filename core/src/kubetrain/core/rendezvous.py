"""Wait for the gang's rendezvous before joining it, polling, instead of leaving it to torch's backoff.

A rank that is not on worker 0 reaches the gang through MASTER_ADDR:MASTER_PORT: worker 0's name under the
job's headless Service, where rank 0 serves torch's TCPStore. torch's client tries again after each failure,
a failed name lookup included, with a delay that grows by 1.5x up to 60 s (c10d's ExponentialBackoffWithJitter:
0.5 s, then about 10 tries in the first minute). A worker kept by an in-place restart starts its ranks at once,
while worker 0's pod is still being recreated: its name does not resolve until that pod has an address, and its
port does not answer until its rank 0 has started; by then torch may be waiting out a delay of 10-30 s. Polling
here every MASTER_POLL_SECONDS and starting the rendezvous once the store answers makes a restart cost what
worker 0's start costs.

A kept worker also learns worker 0's new address from the operator (contract.MASTER_FILE), and once it has it
reaches the store there instead of by name: a name looked up before the new pod was published is cached as
missing by the cluster's DNS for its negative TTL (CoreDNS: 30 s on kubeadm's Corefile, 5 s on the test
cluster's), which would otherwise be the restart's cost.

Standard library only, Python 3.8+: it runs in a custom command's pod beside launcher.py (launcher.FILES).
"""

from __future__ import annotations

import socket
import sys
import time
from typing import TYPE_CHECKING

if __package__:
    from kubetrain.core import contract
else:  # beside launcher.py in the job's ConfigMap
    import contract

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

MASTER_POLL_SECONDS = 0.25
MASTER_SAY_SECONDS = 15.0
"""While waiting, a line this often says what is missing."""
MASTER_WAIT_SECONDS = 300.0
"""After this long the ranks rendezvous anyway: torch's own timeout then names the failure."""
CONNECT_TIMEOUT_SECONDS = 1.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def remote_master(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(MASTER_ADDR, MASTER_PORT) where the store is another worker's: this worker's node rank is not 0 and
    the address is not loopback (a local run). None otherwise."""
    node_rank = contract.env_int(env, contract.NODE_RANK, contract.PET_NODE_RANK, default=0)
    addr = contract.env_value(env, contract.MASTER_ADDR, contract.PET_MASTER_ADDR)
    if node_rank == 0 or not addr or addr in LOOPBACK:
        return None
    return addr, contract.env_int(env, contract.MASTER_PORT, contract.PET_MASTER_PORT, default=contract.DEFAULT_MASTER_PORT)


def master_address(env: Mapping[str, str], generation: int | None = None) -> str | None:
    """Where this worker reaches worker 0 in `generation` (default: the environment's RESTART_GENERATION): the
    address in contract.MASTER_FILE when the file names that generation, else MASTER_ADDR (None: neither)."""
    name = contract.env_value(env, contract.MASTER_ADDR, contract.PET_MASTER_ADDR)
    path = env.get(contract.MASTER_FILE)
    if not path:
        return name
    try:
        with open(path) as f:
            told = f.read().split()
    except OSError:
        return name
    want = contract.env_int(env, contract.RESTART_GENERATION, default=0) if generation is None else generation
    if len(told) == 2 and told[0] == str(want):
        return told[1]
    return name


def store_address(env: Mapping[str, str]) -> str | None:
    """Where a rank of kubetrain's trainer opens the gang's store: on worker 0, which serves it (rank 0's store
    listens on every address of the pod), loopback, so that a new pod never looks up its own name before the
    cluster's DNS has it (a miss is cached: see above); elsewhere :func:`master_address`."""
    node_rank = contract.env_int(env, contract.NODE_RANK, contract.PET_NODE_RANK, default=0)
    return LOOPBACK[0] if node_rank == 0 else master_address(env)


def not_ready(addr: str, port: int, connect: bool = True) -> str | None:
    """None once `addr` resolves and (``connect``) takes a TCP connection on `port`; else why not, in words.
    A connection opened and closed is nothing to torch's TCPStore (it waits for a request)."""
    try:
        found = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"{addr} does not resolve yet ({exc.strerror})"
    if not connect:
        return None
    why = "no address"
    for family, kind, proto, _name, sockaddr in found:
        try:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(CONNECT_TIMEOUT_SECONDS)
                s.connect(sockaddr)
                return None
        except OSError as exc:
            why = exc.strerror or str(exc) or type(exc).__name__
    return f"{addr}:{port} takes no connection yet ({why})"


def await_master(
    env: Mapping[str, str], connect: bool = True, give_up: Callable[[], bool] = lambda: False,
    limit_s: float = MASTER_WAIT_SECONDS, probe: Callable[[str, int, bool], str | None] = not_ready,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
    generation: int | None = None,
) -> float:
    """Block until the remote master (at :func:`master_address` for `generation`) answers (:func:`not_ready`),
    `give_up()` says stop (a stop signal, a newer generation) or `limit_s` has passed; a line on stderr when it
    had to wait. Returns the seconds waited."""
    where = remote_master(env)
    if where is None:
        return 0.0
    port = where[1]
    start = said = clock()
    addr = master_address(env, generation) or where[0]  # read again each round: the operator's word may come
    why = probe(addr, port, connect)
    while why is not None and not give_up() and clock() - start < limit_s:
        if clock() - said >= MASTER_SAY_SECONDS:
            said = clock()
            _say(f"waiting for the gang's rendezvous {addr}:{port} ({clock() - start:.0f}s): {why}")
        sleep(MASTER_POLL_SECONDS)
        addr = master_address(env, generation) or where[0]
        why = probe(addr, port, connect)
    waited = clock() - start
    if why is not None and not give_up():
        _say(f"the gang's rendezvous {addr}:{port} did not answer within {limit_s:g}s ({why}); joining anyway")
    elif waited >= MASTER_POLL_SECONDS:
        _say(f"the gang's rendezvous {addr}:{port} answered after {waited:.1f}s")
    return waited


def _say(message: str) -> None:
    print(f"kubetrain: {message}", file=sys.stderr, flush=True)

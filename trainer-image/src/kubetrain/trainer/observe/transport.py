"""Which network transport NCCL chose, so that a silent fallback to TCP shows.

NCCL picks its network at communicator init and falls back to TCP sockets without a word when a
fabric is not wired into the pod (no RDMA device resource, no aws-ofi-nccl or TCPX plugin, a wrong
HCA). The only record of the choice is NCCL's own debug log, so before ``init_process_group`` every
rank asks NCCL for INFO lines of the INIT and NET subsystems in a per-rank file
(``<output dir>/nccl/rank-<rank>.log``, the temp dir without one), unless the user set ``NCCL_DEBUG`` (then their logging stays
as it is and the transport is not probed). After the first collective (NCCL connects its channels
lazily, on first use) rank 0 parses its file: :func:`parse_nccl_log` is pure, the rest is plumbing.

NCCL's wording, as its sources print it (checked against NVIDIA/nccl, aws/aws-ofi-nccl and
google/nccl-plugin-gpudirecttcpx):

- ``src/init.cc``: ``INFO(NCCL_INIT, "Using network %s", comm->ncclNet->name)`` -- the net in use:
  ``IB`` (InfiniBand and RoCE), ``Socket``, or a plugin's name: ``Libfabric`` (aws-ofi-nccl,
  ``src/nccl_ofi_interface_nvidia.cpp``; ``AWS Libfabric`` in older releases), ``GPUDirectTCPX_v7``
  (``src/nccl_plugin.cc`` of the TCPX plugin), ``FasTrak`` (GKE's TCPXO plugin, as its logs show it);
- ``src/transport/net_ib/init.cc``: ``"NET/IB : Using%s %s; OOB %s:%s"`` with ``[0]mlx5_0:1/IB``
  per device; ``src/transport/net_socket.cc``: ``"NET/Socket : Using%s"`` with ``[0]eth0:<addr>``;
- aws-ofi-nccl ``src/nccl_ofi_net.cpp``: ``"NET/OFI Selected provider is %s, fabric is %s (found %d
  nics)"`` (older releases: ``Selected Provider is efa``);
- ``src/transport/net.cc``: ``"Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d..."``;
  ``p2p.cc`` / ``shm.cc``: ``... via P2P/...`` and ``... via SHM/direct`` for connections within a node.

Every line starts ``host:pid:tid [cudaDev] NCCL INFO `` (``src/debug.cc``).
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from kubetrain.core import contract
from kubetrain.core.lifecycle.status import fabric_mismatch

log = logging.getLogger("kubetrain.trainer")

NCCL_DEBUG = "NCCL_DEBUG"
NCCL_DEBUG_SUBSYS = "NCCL_DEBUG_SUBSYS"
NCCL_DEBUG_FILE = "NCCL_DEBUG_FILE"
LOG_DIR = "nccl"
"""Under the output directory: one NCCL log per rank, rewritten by every generation."""

_USING_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
_DEVICES = re.compile(r"NET/(IB|Socket) : Using((?: \[\d+\][^\s;]+)+)")
_OFI_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is ([^\s,]+)")
_CHANNEL = re.compile(r"NCCL INFO Channel \d+(?:/\d+)? : .*? via (\S+)")

_NETWORKS: tuple[tuple[str, str], ...] = (
    ("IB", contract.TRANSPORT_IB),
    ("Socket", contract.TRANSPORT_SOCKET),
    ("Libfabric", contract.TRANSPORT_OFI),
    ("AWS Libfabric", contract.TRANSPORT_OFI),
    ("GPUDirectTCPX", contract.TRANSPORT_TCPX),
    ("FasTrak", contract.TRANSPORT_TCPXO),
)
"""NCCL's net name (a prefix: plugins append their API version, `GPUDirectTCPX_v7`) -> our transport."""


@dataclass(frozen=True)
class NcclNetLog:
    """What one rank's NCCL log says about the network."""

    network: str | None = None
    """NCCL's name of the net it uses (`Using network ...`); None: no such line (yet)."""
    devices: tuple[str, ...] = ()
    """The IB HCAs (`mlx5_0:1/IB`) or socket interfaces (`eth0`) NCCL's own transports use."""
    provider: str | None = None
    """The libfabric provider aws-ofi-nccl selected (`efa`)."""
    channels: int = 0
    """Connections of this rank NCCL set up (one line per channel and peer)."""
    net_channels: int = 0
    """Of them, those through the network (`via NET/...`)."""


def parse_nccl_log(lines: Iterable[str]) -> NcclNetLog:
    """The network facts in NCCL's INFO lines (any other line is skipped)."""
    network, provider, devices = None, None, ()
    channels = net_channels = 0
    for line in lines:
        if m := _USING_NETWORK.search(line):
            network = m.group(1)
        elif m := _DEVICES.search(line):
            found = re.findall(r"\[\d+\]([^\s;]+)", m.group(2))
            devices = tuple(d.split(":")[0] if m.group(1) == "Socket" else d for d in found)
        elif m := _OFI_PROVIDER.search(line):
            provider = m.group(1)
        elif m := _CHANNEL.search(line):
            channels += 1
            net_channels += m.group(1).startswith("NET/")
    return NcclNetLog(network, devices, provider, channels, net_channels)


def transport_of(parsed: NcclNetLog, multi_node: bool) -> str | None:
    """Our name of the transport (contract.TRANSPORT_*); None when NCCL's log does not say.

    On one node nothing crosses a network unless a channel goes `via NET/` (P2P or SHM otherwise,
    whatever net NCCL initialised); across nodes the net NCCL uses is the transport."""
    if parsed.network is None:
        return None
    if not multi_node and parsed.net_channels == 0:
        return contract.TRANSPORT_LOCAL
    for name, transport in _NETWORKS:
        if parsed.network == name or parsed.network.startswith(f"{name}_"):
            return transport
    return parsed.network  # a net plugin we do not know: its own name


def describe(parsed: NcclNetLog, transport: str | None) -> str:
    """The start-up log line's text: `NET/IB (mlx5_0:1/IB, mlx5_1:1/IB)`, `NET/Socket (eth0)`, ..."""
    if transport is None:
        return "unknown (NCCL logged no 'Using network' line)"
    if transport == contract.TRANSPORT_LOCAL:
        return f"P2P/SHM only (one node; NCCL's network {parsed.network} is not used)"
    details = list(parsed.devices)
    if parsed.provider:
        details.append(f"provider {parsed.provider}")
    return f"NET/{transport}" + (f" ({', '.join(details)})" if details else "")


def prepare(rank: int, output_dir: Path | None, environ: MutableMapping[str, str]) -> Path | None:
    """Before init_process_group: NCCL writes its INIT and NET INFO lines to this rank's file. None (and
    nothing changed) when the user set NCCL_DEBUG: their NCCL logging stays as they asked."""
    if environ.get(NCCL_DEBUG):
        return None
    root = output_dir if output_dir is not None else Path(tempfile.gettempdir()) / "kubetrain"
    path = root / LOG_DIR / f"rank-{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # an earlier generation's log must not speak for this one
    environ[NCCL_DEBUG] = "INFO"
    environ[NCCL_DEBUG_SUBSYS] = "INIT,NET"
    environ[NCCL_DEBUG_FILE] = str(path)
    return path


def read_log(path: Path) -> NcclNetLog:
    try:
        with path.open(errors="replace") as f:
            return parse_nccl_log(f)
    except OSError:
        return NcclNetLog()


def detect(
    *, rank: int, multi_node: bool, nccl: bool, log_file: Path | None, fabric: str,
    first_collective: Callable[[], None],
) -> str | None:
    """The transport this gang uses, logged by rank 0 (with a warning when spec.fabric expects another).

    Collective under NCCL: every rank runs `first_collective`, so that NCCL connects its channels and logs
    how; only rank 0 reads its log. gloo (CPU) is `gloo`, with no parsing and no collective."""
    if nccl:
        first_collective()  # on every rank whatever it probes: a collective that one rank skips hangs
    if rank != 0:
        return None
    transport: str | None = contract.TRANSPORT_GLOO
    text = "gloo (TCP)"
    if nccl and log_file is None:
        transport, text = None, f"not probed ({NCCL_DEBUG} is set: NCCL logs as you asked)"
    elif nccl and log_file is not None:
        parsed = read_log(log_file)
        transport = transport_of(parsed, multi_node)
        text = describe(parsed, transport)
    log.info("%s transport: %s", "NCCL" if nccl else "network", text)
    bad = fabric_mismatch(fabric, transport)
    if bad is not None:
        log.warning("%s", bad[1])
    return transport

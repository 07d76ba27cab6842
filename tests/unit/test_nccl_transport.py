"""Which network transport NCCL chose: the log parser (NCCL's own lines), the probe's set-up and rank 0's report.

The NCCL path needs GPUs; here the first collective is a stand-in that writes what NCCL would write.
Lines are as NCCL's debug.cc prints them (`host:pid:tid [cudaDev] NCCL INFO ...`), their text as NCCL,
aws-ofi-nccl and the GKE plugins log it (see kubetrain.trainer.observe.transport).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from kubetrain.core import contract
from kubetrain.core.progress import Progress
from kubetrain.trainer.observe import transport as nt
from kubetrain.trainer.observe.progress import annotation_value


def _lines(*texts: str) -> list[str]:
    return [f"gpu-node-0:312:312 [0] NCCL INFO {t}\n" for t in texts]


VERSION = "NCCL version 2.27.3+cuda12.9"
IB = _lines(
    VERSION,
    "NET/Plugin: Could not find: libnccl-net.so. Using internal net plugin.",
    "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB eth0:10.0.0.7<0>",
    "Using network IB",
    "Channel 00/0 : 15[7] -> 0[0] [receive] via NET/IB/0/GDRDMA/flush=None",
    "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
)
ROCE = _lines(
    "NET/IB : Using [0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE ; OOB eth0:10.0.0.7<0>",
    "Using network IB",
    "Channel 01/0 : 0[0] -> 8[0] [send] via NET/IB/0(1)/GDRDMA",
)
SOCKET = _lines(
    VERSION,
    "NET/IB : No device found.",
    "NET/Socket : Using [0]eth0:10.140.0.7<0>",
    "Using network Socket",
    "Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0",
    "Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0",
)
EFA = _lines(
    "NET/OFI Initializing aws-ofi-nccl 1.16.2",
    "NET/OFI Selected provider is efa, fabric is efa-direct (found 32 nics)",
    "Using network Libfabric",
    "Channel 00/0 : 0[0] -> 1[0] [send] via NET/Libfabric/0/GDRDMA",
)
EFA_OLD = _lines(
    "NET/OFI Selected Provider is efa (found 4 nics)",
    "Using network AWS Libfabric",
    "Channel 00/0 : 0[0] -> 8[0] [send] via NET/AWS Libfabric/0/GDRDMA",
)
TCPX = _lines("Using network GPUDirectTCPX_v7", "Channel 00/0 : 0[0] -> 8[0] [send] via NET/GPUDirectTCPX_v7/0")
TCPXO = _lines("Using network FasTrak", "Channel 00/0 : 0[0] -> 8[0] [send] via NET/FasTrak/0")
ONE_NODE = _lines(
    "NET/IB : Using [0]mlx5_0:1/IB [RO]; OOB eth0:10.0.0.7<0>",
    "Using network IB",
    "Channel 00/02 : 0[0] -> 1[1] via P2P/IPC",
    "Channel 01 : 0[0] -> 1[1] via SHM/direct/direct",
)
ONE_NODE_OVER_NET = _lines("Using network Socket", "Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0")


@pytest.mark.parametrize(("lines", "multi_node", "transport", "text"), [
    (IB, True, contract.TRANSPORT_IB, "NET/IB (mlx5_0:1/IB, mlx5_1:1/IB)"),
    (ROCE, True, contract.TRANSPORT_IB, "NET/IB (mlx5_0:1/RoCE, mlx5_1:1/RoCE)"),
    (SOCKET, True, contract.TRANSPORT_SOCKET, "NET/Socket (eth0)"),
    (EFA, True, contract.TRANSPORT_OFI, "NET/OFI (provider efa)"),
    (EFA_OLD, True, contract.TRANSPORT_OFI, "NET/OFI (provider efa)"),
    (TCPX, True, contract.TRANSPORT_TCPX, "NET/GPUDirectTCPX"),
    (TCPXO, True, contract.TRANSPORT_TCPXO, "NET/FasTrak"),
    (ONE_NODE, False, contract.TRANSPORT_LOCAL, "P2P/SHM only (one node; NCCL's network IB is not used)"),
    (ONE_NODE_OVER_NET, False, contract.TRANSPORT_SOCKET, "NET/Socket"),
    (_lines("Using network IB"), False, contract.TRANSPORT_LOCAL, "P2P/SHM only"),  # one rank: no connections
    (_lines("Using network IB"), True, contract.TRANSPORT_IB, "NET/IB"),  # channels not connected yet
    (_lines("Using network MyNet_v9"), True, "MyNet_v9", "NET/MyNet_v9"),
    (_lines(VERSION, "NET/IB : No device found."), True, None, "unknown"),
    ([], True, None, "unknown"),
])
def test_transport_from_real_nccl_lines(lines: list[str], multi_node: bool, transport: str | None, text: str) -> None:
    parsed = nt.parse_nccl_log(lines)
    assert nt.transport_of(parsed, multi_node) == transport
    assert nt.describe(parsed, transport).startswith(text)


def test_parser_counts_connections_and_skips_other_lines() -> None:
    parsed = nt.parse_nccl_log([*IB, "not NCCL at all\n", "gpu-node-0:312:312 [0] NCCL WARN Cuda failure\n"])
    assert parsed == nt.NcclNetLog(network="IB", devices=("mlx5_0:1/IB", "mlx5_1:1/IB"), channels=2, net_channels=1)


def test_prepare_points_nccl_at_a_per_rank_file(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    stale = tmp_path / "nccl" / "rank-3.log"
    stale.parent.mkdir()
    stale.write_text("".join(SOCKET))
    path = nt.prepare(3, tmp_path, env)
    assert path == stale and not stale.exists()  # an earlier generation's log does not speak for this one
    assert env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": str(stale)}


def test_prepare_leaves_the_users_nccl_logging_alone(tmp_path: Path) -> None:
    env = {"NCCL_DEBUG": "WARN"}
    assert nt.prepare(0, tmp_path, env) is None
    assert env == {"NCCL_DEBUG": "WARN"}
    assert not (tmp_path / "nccl").exists()


def test_prepare_without_an_output_dir_uses_the_temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nt.tempfile, "tempdir", str(tmp_path))
    env: dict[str, str] = {}
    assert nt.prepare(0, None, env) == tmp_path / "kubetrain" / "nccl" / "rank-0.log"


def _fake_nccl(path: Path, lines: list[str], calls: list[int]) -> Callable[[], None]:
    def collective() -> None:
        calls.append(1)
        path.write_text("".join(lines))
    return collective


def test_rank0_parses_its_log_after_the_first_collective(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, calls = tmp_path / "rank-0.log", []
    with caplog.at_level(logging.INFO, logger="kubetrain.trainer"):
        got = nt.detect(rank=0, multi_node=True, nccl=True, log_file=path, fabric="efa",
                        first_collective=_fake_nccl(path, SOCKET, calls))
    assert got == contract.TRANSPORT_SOCKET and calls == [1]
    assert "NCCL transport: NET/Socket (eth0)" in caplog.text
    warning = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and "expects NCCL transport OFI, but rank 0 reports Socket" in warning[0].message


def test_other_ranks_join_the_collective_and_report_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, calls = tmp_path / "rank-1.log", []
    with caplog.at_level(logging.INFO, logger="kubetrain.trainer"):
        got = nt.detect(rank=1, multi_node=True, nccl=True, log_file=path, fabric="efa",
                        first_collective=_fake_nccl(path, SOCKET, calls))
    assert got is None and calls == [1] and "transport" not in caplog.text


def test_fabric_transport_logs_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "rank-0.log"
    with caplog.at_level(logging.INFO, logger="kubetrain.trainer"):
        got = nt.detect(rank=0, multi_node=True, nccl=True, log_file=path, fabric="efa",
                        first_collective=_fake_nccl(path, EFA, []))
    assert got == contract.TRANSPORT_OFI
    assert "NCCL transport: NET/OFI (provider efa)" in caplog.text and "WARNING" not in caplog.text


def test_gloo_is_reported_without_parsing_or_collective(caplog: pytest.LogCaptureFixture) -> None:
    def never() -> None:
        raise AssertionError("no collective for gloo")

    with caplog.at_level(logging.INFO, logger="kubetrain.trainer"):
        assert nt.detect(rank=0, multi_node=False, nccl=False, log_file=None, fabric="none",
                         first_collective=never) == contract.TRANSPORT_GLOO
        assert nt.detect(rank=1, multi_node=False, nccl=False, log_file=None, fabric="none",
                         first_collective=never) is None
    assert "network transport: gloo (TCP)" in caplog.text


def test_user_nccl_debug_means_not_probed_but_the_collective_is_still_joined(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []
    with caplog.at_level(logging.INFO, logger="kubetrain.trainer"):
        got = nt.detect(rank=0, multi_node=True, nccl=True, log_file=None, fabric="infiniband",
                        first_collective=lambda: calls.append(1))
    assert got is None and calls == [1] and "NCCL transport: not probed (NCCL_DEBUG is set" in caplog.text
    assert "WARNING" not in caplog.text  # unknown is no mismatch


def test_missing_log_file_is_unknown(tmp_path: Path) -> None:
    got = nt.detect(rank=0, multi_node=True, nccl=True, log_file=tmp_path / "absent.log", fabric="infiniband",
                    first_collective=lambda: None)
    assert got is None


def test_progress_record_carries_the_transport_and_stays_compatible() -> None:
    record = Progress(job="j", step=3, network_transport=contract.TRANSPORT_SOCKET)
    assert json.loads(annotation_value(record))["networkTransport"] == "Socket"
    assert "networkTransport" not in Progress(job="j").dump()  # unknown: left out, as before
    older = Progress.model_validate({"job": "j", "step": 2})
    assert older.network_transport is None
    newer = Progress.model_validate({"job": "j", "step": 2, "someFutureField": {"x": 1}})
    assert newer.step == 2  # a newer trainer's extra fields do not make its progress unreadable

"""The wait for the gang's rendezvous on another worker (kubetrain.core.rendezvous), and the launcher that holds a
kept worker's standby ranks until worker 0's store answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from support.ports import free_port
from support.waiting import wait_for

from kubetrain.core import contract, rendezvous

REMOTE = {contract.NODE_RANK: "1", contract.MASTER_ADDR: "llm-worker-0.llm", contract.MASTER_PORT: "29500"}


@pytest.mark.parametrize(("env", "expected"), [
    (REMOTE, ("llm-worker-0.llm", 29500)),
    ({contract.PET_NODE_RANK: "2", contract.PET_MASTER_ADDR: "w-0.s"}, ("w-0.s", contract.DEFAULT_MASTER_PORT)),
    ({**REMOTE, contract.NODE_RANK: "0"}, None),  # worker 0's rank 0 serves the store
    ({**REMOTE, contract.MASTER_ADDR: "127.0.0.1"}, None),  # a local run
    ({contract.NODE_RANK: "1"}, None),
])
def test_only_a_master_on_another_worker_is_waited_for(env, expected):
    assert rendezvous.remote_master(env) == expected


class Clock:
    """A fake clock the fake sleep advances."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_wait_polls_until_the_name_resolves_and_the_store_answers(capsys):
    clock = Clock()
    answers = iter(["w-0 does not resolve yet (Temporary failure in name resolution)"] * 80 +
                   ["w-0:29500 takes no connection yet (Connection refused)"] * 20 + [None])
    seen = []

    def probe(addr: str, port: int, connect: bool) -> str | None:
        seen.append((addr, port, connect, clock.now))
        return next(answers)

    env = {**REMOTE, contract.MASTER_ADDR: "w-0"}
    waited = rendezvous.await_master(env, probe=probe, clock=clock, sleep=clock.sleep)
    assert waited == pytest.approx(100 * rendezvous.MASTER_POLL_SECONDS)  # 25 s: the name at 20 s, the port at 25
    gaps = {round(b[3] - a[3], 6) for a, b in zip(seen, seen[1:], strict=False)}
    assert gaps == {rendezvous.MASTER_POLL_SECONDS} and all(s[:3] == ("w-0", 29500, True) for s in seen)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("kubetrain: waiting for the gang's rendezvous w-0:29500 (15s): w-0 does not resolve")
    assert err[-1] == "kubetrain: the gang's rendezvous w-0:29500 answered after 25.0s"


def test_the_wait_ends_on_give_up_or_at_its_limit_and_never_for_worker_0(capsys):
    clock = Clock()
    never = lambda *_: "w-0 does not resolve yet (x)"  # noqa: E731
    assert rendezvous.await_master(REMOTE, probe=never, clock=clock, sleep=clock.sleep,
                                   give_up=lambda: clock.now >= 103) == pytest.approx(3.0)
    assert "joining anyway" not in capsys.readouterr().err
    waited = rendezvous.await_master(REMOTE, probe=never, clock=clock, sleep=clock.sleep, limit_s=60)
    assert waited == pytest.approx(60.0)
    assert "did not answer within 60s (w-0 does not resolve yet (x)); joining anyway" in capsys.readouterr().err
    assert rendezvous.await_master({**REMOTE, contract.NODE_RANK: "0"}, probe=never) == 0.0


def test_a_name_that_does_not_resolve_and_a_port_that_refuses_are_said(monkeypatch):
    port = free_port()
    assert rendezvous.not_ready("127.0.0.1", port) == f"127.0.0.1:{port} takes no connection yet (Connection refused)"
    assert rendezvous.not_ready("127.0.0.1", port, connect=False) is None
    with socket.create_server(("127.0.0.1", port)):
        assert rendezvous.not_ready("127.0.0.1", port) is None

    def no_name(*_args: object, **_kw: object) -> None:  # the resolver faked: no DNS query leaves this machine
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", no_name)
    assert rendezvous.not_ready("w-0.s", port) == "w-0.s does not resolve yet (Temporary failure in name resolution)"


IN_PLACE_RANK = """import os, sys
g = os.environ['KUBETRAIN_RESTART_GENERATION']
open(os.path.join(sys.argv[1], 'ran-%s-%s' % (g, os.environ['LOCAL_RANK'])), 'w').close()
sys.exit(3 if g == '0' else 0)
"""

# The launcher with its resolver faked (no DNS query may leave this machine): worker 0's name resolves once the
# file `resolvable` exists, as once the recreated pod has its address.
LAUNCHER = """import os, socket, sys
real, d = socket.getaddrinfo, sys.argv[1]
def getaddrinfo(host, *a, **kw):
    if host == 'w-0.s' and not os.path.exists(os.path.join(d, 'resolvable')):
        raise socket.gaierror(socket.EAI_AGAIN, 'Temporary failure in name resolution')
    return real('127.0.0.1' if host == 'w-0.s' else host, *a, **kw)
socket.getaddrinfo = getaddrinfo
from kubetrain.core.launcher import launch
sys.exit(launch([sys.executable, '-c', sys.argv[2], d]))
"""


def kept_worker(tmp_path, rank_script: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Worker 1's launcher (2 ranks) in a pod that restarts in place, its generation file `tmp_path/generation`
    at 0 and worker 0's name resolvable, once generation 0's ranks have run (they lose their peer: exit 3)."""
    gen = tmp_path / "generation"
    gen.write_text("0")
    (tmp_path / "resolvable").touch()
    env = {**os.environ, "PET_NPROC_PER_NODE": "2", contract.NODE_RANK: "1", contract.MASTER_ADDR: "w-0.s",
           contract.RESTART_GENERATION: "0", contract.GENERATION_FILE: str(gen), contract.IN_PLACE_WAIT: "60",
           **(env or {})}
    p = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), rank_script], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (tmp_path / "ran-0-0").exists() and (tmp_path / "ran-0-1").exists(), 60,
                 what="generation 0's ranks")
    except BaseException:
        p.kill()
        raise
    return p


def test_a_kept_worker_starts_its_next_generation_once_worker_0s_name_resolves(tmp_path):
    """Worker 1 kept in place: its generation-0 ranks lost their peer; generation 1 is announced while worker 0's
    recreated pod has no address yet: the ranks start once its name resolves, not before."""
    gen = tmp_path / "generation"
    p = kept_worker(tmp_path, IN_PLACE_RANK)
    try:
        (tmp_path / "resolvable").unlink()
        gen.write_text("1")
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=4 * rendezvous.MASTER_POLL_SECONDS + 2)
        assert not list(tmp_path.glob("ran-1-*"))  # held: worker 0's name does not resolve
        (tmp_path / "resolvable").touch()
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert (tmp_path / "ran-1-0").exists() and (tmp_path / "ran-1-1").exists()
    assert "kubetrain: the gang's rendezvous w-0.s:29500 answered after" in err



@pytest.mark.parametrize(("told", "generation", "expected"), [
    ("3 10.88.1.7\n", 3, "10.88.1.7"),  # the operator's word for this generation
    ("3 fd00::7", 3, "fd00::7"),
    ("2 10.88.1.7", 3, "w-0.s"),  # an older generation's worker 0
    ("3", 3, "w-0.s"),  # told before worker 0's new pod had an address
    ("", 3, "w-0.s"),  # the annotation not set: the Downward API writes an empty file
    (None, 3, "w-0.s"),  # no file
])
def test_a_kept_worker_reaches_worker_0_at_the_address_it_was_told_for_its_generation(tmp_path, told, generation,
                                                                                       expected):
    path = tmp_path / "master"
    if told is not None:
        path.write_text(told)
    env = {**REMOTE, contract.MASTER_ADDR: "w-0.s", contract.MASTER_FILE: str(path),
           contract.RESTART_GENERATION: str(generation)}
    assert rendezvous.master_address(env) == expected
    assert rendezvous.master_address({**env, contract.RESTART_GENERATION: "0"}, generation) == expected


def test_the_wait_takes_worker_0s_address_the_moment_it_is_told(tmp_path, capsys):
    """The name stays unresolvable (a miss cached by the cluster's DNS); the address answers at once."""
    clock, path = Clock(), tmp_path / "master"
    path.write_text("1")
    seen = []

    def probe(addr: str, port: int, connect: bool) -> str | None:
        seen.append(addr)
        if len(seen) == 8:
            path.write_text("1 10.88.1.7")
        return None if addr == "10.88.1.7" else f"{addr} does not resolve yet (Name or service not known)"

    env = {**REMOTE, contract.MASTER_ADDR: "w-0.s", contract.MASTER_FILE: str(path), contract.RESTART_GENERATION: "1"}
    waited = rendezvous.await_master(env, probe=probe, clock=clock, sleep=clock.sleep)
    assert seen == ["w-0.s"] * 8 + ["10.88.1.7"] and waited == pytest.approx(8 * rendezvous.MASTER_POLL_SECONDS)
    assert capsys.readouterr().err.strip() == "kubetrain: the gang's rendezvous 10.88.1.7:29500 answered after 2.0s"


ADDRESSED_RANK = """import os, sys
g = os.environ['KUBETRAIN_RESTART_GENERATION']
with open(os.path.join(sys.argv[1], 'ran-%s-%s' % (g, os.environ['LOCAL_RANK'])), 'w') as f:
    f.write(os.environ['MASTER_ADDR'])
sys.exit(3 if g == '0' else 0)
"""


def test_a_kept_worker_told_worker_0s_address_starts_its_ranks_there_without_the_name(tmp_path):
    """Worker 0's name never resolves again here; generation 1 comes with its address (one Downward API volume:
    both files at once), and the ranks start with MASTER_ADDR set to it."""
    gen, master = tmp_path / "generation", tmp_path / "master"
    p = kept_worker(tmp_path, ADDRESSED_RANK, {contract.MASTER_FILE: str(master)})
    try:
        (tmp_path / "resolvable").unlink()
        master.write_text("1 127.0.0.1")
        gen.write_text("1")
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert (tmp_path / "ran-0-0").read_text() == "w-0.s"
    assert [(tmp_path / f"ran-1-{i}").read_text() for i in (0, 1)] == ["127.0.0.1", "127.0.0.1"]
    assert "does not resolve" not in err


def test_worker_0_opens_the_store_on_loopback_and_the_others_where_they_were_told(tmp_path):
    """A new worker 0's rank 0 looked its own name up before the cluster's DNS had it (c10d's `gai error: -3`,
    retried for seconds); the store listens on every address of the pod."""
    path = tmp_path / "master"
    path.write_text("1 10.88.1.7")
    env = {**REMOTE, contract.MASTER_ADDR: "w-0.s", contract.MASTER_FILE: str(path), contract.RESTART_GENERATION: "1"}
    assert rendezvous.store_address({**env, contract.NODE_RANK: "0"}) == "127.0.0.1"
    assert rendezvous.store_address(env) == "10.88.1.7"
    assert rendezvous.store_address({contract.PET_NODE_RANK: "1", contract.PET_MASTER_ADDR: "w-0.s"}) == "w-0.s"

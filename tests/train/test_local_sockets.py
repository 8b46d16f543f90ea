"""A job on one machine is not reachable from the network: every socket a local launch (``domainflow train/predict
--domain N``) or a 1-rank group listens on is bound to loopback, even with a cluster profile's
``GLOO_SOCKET_IFNAME`` pointing at a network interface; a job started by the user's own launcher keeps the
user's addresses. Real processes, real Gloo groups, the sockets as the kernel lists them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

psutil = pytest.importorskip("psutil")

LOOPBACK = {"127.0.0.1", "::1"}


def _network_interface() -> tuple[str, str] | None:
    """A network interface that is up and has an IPv4 address other than loopback: (name, address)."""
    stats = psutil.net_if_stats()
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127.") and name in stats and stats[name].isup:
                return name, a.address
    return None


NET = _network_interface()
# a cluster profile's setting: without the fix, Gloo's pairs listen on this interface's address
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "DOMAINFLOW_COLLECTIVE_TIMEOUT": "60",
       **({"GLOO_SOCKET_IFNAME": NET[0]} if NET else {})}
for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(key, None)

_LISTENING = '''
import json, os, sys

def listening(pid):
    """Every LISTEN socket of process ``pid`` and its descendants: [pid, address, port]."""
    import psutil

    root = psutil.Process(pid)
    out = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            out += [[proc.pid, c.laddr.ip, c.laddr.port] for c in proc.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
    return out
'''

_LAUNCH = _LISTENING + '''
def rank(launcher):
    """While the whole job is up (both ranks' groups formed), the job's listening sockets."""
    import torch.distributed as dist

    import domainflow as df

    df.init_mesh((1, 2), ("dp", "domain"))
    dist.barrier()
    got = listening(launcher)
    dist.barrier()
    return {"sockets": got, "pid": os.getpid()}

if __name__ == "__main__":
    from domainflow.launch import launch_local

    print("RESULT", json.dumps(launch_local(rank, 2, os.getpid())))
'''

_ALONE = _LISTENING + '''
import domainflow as df

df.init_mesh((1, 1), ("dp", "domain"))
print("RESULT", json.dumps({"sockets": listening(os.getpid()), "pid": os.getpid()}))
'''


def _run(tmp_path, code: str, env: dict) -> dict:
    script = tmp_path / "job.py"
    script.write_text(code)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_a_local_launch_listens_on_loopback_only(tmp_path):
    """The launcher's store (the rendezvous and the ranks' shared store) and every rank's Gloo pairs."""
    out = _run(tmp_path, _LAUNCH, ENV)
    ranks = {out[r]["pid"] for r in ("0", "1")}
    for r in ("0", "1"):
        sockets = out[r]["sockets"]
        owners = {pid for pid, _, _ in sockets}
        assert ranks <= owners and len(owners) == 3, sockets  # the launcher's store, each rank's Gloo pairs
        exposed = [s for s in sockets if s[1] not in LOOPBACK]
        assert not exposed, f"listening beyond loopback: {exposed} (all: {sockets})"


def test_a_one_rank_group_listens_on_loopback_only(tmp_path):
    """``init_mesh`` in a plain process: Gloo's pairs of its in-process group (and of the mesh's groups)."""
    if NET is None:
        pytest.skip("no network interface to point GLOO_SOCKET_IFNAME at")
    out = _run(tmp_path, _ALONE, ENV)
    sockets = out["sockets"]
    assert sockets and not [s for s in sockets if s[1] not in LOOPBACK], sockets


def test_the_users_own_launch_keeps_the_users_interface(tmp_path):
    """Under the user's launcher (RANK, WORLD_SIZE, MASTER_ADDR set: a multi-node job) the interface the user
    named is used, not replaced by loopback."""
    if NET is None:
        pytest.skip("no network interface to point GLOO_SOCKET_IFNAME at")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**ENV, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    out = _run(tmp_path, _ALONE, env)
    assert NET[1] in {a for _, a, _ in out["sockets"]}, (NET, out["sockets"])

"""Two nodes on one machine: two network namespaces joined by a veth pair, one torchrun agent in each, a c10d
rendezvous hosted by node 0, gloo over the veth and one shared dump_dir (docs/cluster.md, "Several nodes"). They
need root and iproute2: elsewhere the tests skip, except under CI (CI=true), which runs as root and must run them."""

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import (
    ENV,
    LONG_RUN_STEPS,
    end,
    long_run_argv,
    read_metrics,
    run_to_the_end,
    running,
    start,
    tagged_processes,
    write_corpus,
)

from lingua.checkpoint.store import CheckpointArgs, CheckpointManager

PREFIX = "lingua-mn"  # namespaces are PREFIX-PID-NODE: PID is the pytest process that made them
ADDRESSES = ("10.231.0.1", "10.231.0.2")  # the veth ends' addresses, inside the namespaces only
PORTS = itertools.count(29400)  # each job's rendezvous port on node 0: no job waits for the last one's to close


@dataclass(frozen=True)
class Node:
    """One machine of the job: a network namespace and its end of the veth pair."""

    namespace: str
    interface: str  # this side's veth, named in GLOO_SOCKET_IFNAME
    address: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _unavailable(reason: str) -> None:
    """Skips, or fails under CI, which must run these tests."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"the multi-node tests cannot run: {reason}")
    pytest.skip(reason)


def _remove(namespace: str, interface: str | None = None) -> None:
    """Kills every process in the namespace (only these tests start any), then deletes it, its veth end and its
    /etc/netns folder."""
    deadline = time.time() + 30
    while time.time() < deadline:
        pids = [int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not any(running(pid) for pid in pids):
            break
        time.sleep(0.05)
    _ip("netns", "del", namespace, check=False)  # also deletes the veth pair whose end it holds
    if interface is not None:
        _ip("link", "del", interface, check=False)  # an end still outside (a set-up that failed half-way)
    shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)


def _layout(pid: int) -> list[Node]:
    """The two nodes that pytest process `pid` makes."""
    return [Node(f"{PREFIX}-{pid}-{i}", f"lmn{pid}{'ab'[i]}", ADDRESSES[i]) for i in range(2)]


def _remove_stale_namespaces() -> None:
    """The nodes of a pytest process that no longer runs (killed before its finalizers ran; this one if its pid
    was reused)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        match = re.match(rf"{PREFIX}-(\d+)-\d\b", line)
        if match and (int(match.group(1)) == os.getpid() or not running(int(match.group(1)))):
            for node in _layout(int(match.group(1))):
                _remove(node.namespace, node.interface)


def _hosts(nodes: list[Node], this: Node) -> str:
    """A namespace's /etc/hosts (`ip netns exec` mounts /etc/netns/NS/hosts over it): as on a cluster, the machine's
    hostname resolves to this node's reachable address, not to 127.0.0.1, and each node's address has a name, also
    in its IPv4-mapped form, which c10d looks up for the peers of its store (else it warns that it cannot)."""
    lines = ["127.0.0.1 localhost"]
    for i, node in enumerate(nodes):
        names = f"node{i}" + (f" {os.uname().nodename}" if node == this else "")
        lines += [f"{node.address} {names}", f"::ffff:{node.address} {names}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def nodes(request) -> list[Node]:
    """Two namespaces joined by a veth pair, each with its end's address and `lo` up; removed with every process in
    them when the module ends, whether its tests passed or not."""
    if os.geteuid() != 0:
        _unavailable("network namespaces need root")
    if shutil.which("ip") is None:
        _unavailable("network namespaces need iproute2's `ip`")
    _remove_stale_namespaces()
    made = _layout(os.getpid())
    request.addfinalizer(lambda: [_remove(node.namespace, node.interface) for node in made])
    try:
        for node in made:
            _ip("netns", "add", node.namespace)
        _ip("link", "add", made[0].interface, "type", "veth", "peer", "name", made[1].interface)
        for node in made:
            _ip("link", "set", node.interface, "netns", node.namespace)
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.interface)
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            _ip("-n", node.namespace, "link", "set", node.interface, "up")
            folder = Path("/etc/netns") / node.namespace
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(_hosts(made, node))
    except (RuntimeError, OSError) as e:
        _unavailable(f"cannot make two network namespaces joined by a veth pair: {e}")
    return made


class Job:
    """One training command launched on both nodes: a torchrun agent per node, whose output goes to files."""

    def __init__(self, nodes: list[Node], folder: Path, argv: list[str], procs: int = 1):
        folder.mkdir(parents=True, exist_ok=True)
        self.logs = [folder / f"node{i}.err" for i in range(2)]
        port, run_id = next(PORTS), uuid.uuid4().hex  # a fresh rendezvous per job
        self.agents = []
        try:
            for i, node in enumerate(nodes):
                cmd = ["ip", "netns", "exec", node.namespace, sys.executable, "-m", "torch.distributed.run",
                       "--nnodes=2", f"--nproc-per-node={procs}", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint={nodes[0].address}:{port}", f"--rdzv-id={run_id}",
                       f"--local-addr={node.address}", "-m", "apps.bert.train", *argv]
                with open(folder / f"node{i}.out", "w") as out, open(self.logs[i], "w") as err:
                    self.agents.append(start(cmd, {**ENV, "GLOO_SOCKET_IFNAME": node.interface}, stdout=out,
                                             stderr=err))
        except BaseException:
            self.end()
            raise

    def ranks(self) -> list[list[int]]:
        """The global ranks of each node's training workers now running."""
        return [sorted({rank for pid in tagged_processes(agent.tag) if (rank := _rank(pid)) is not None})
                for agent in self.agents]

    def wait(self, timeout: float = 180) -> list[int]:
        """Each agent's exit status (TimeoutExpired if they outlast `timeout`)."""
        deadline = time.time() + timeout
        for agent in self.agents:
            agent.wait(timeout=max(deadline - time.time(), 0))
        return [agent.returncode for agent in self.agents]

    def end(self) -> None:
        for agent in self.agents:
            end(agent)

    def stderr(self, node: int) -> str:
        return self.logs[node].read_text()


def _rank(pid: int) -> int | None:
    """RANK of a training worker (a process running the training module), else None."""
    try:
        cmdline, environ = (Path(f"/proc/{pid}/{name}").read_bytes() for name in ("cmdline", "environ"))
    except OSError:
        return None
    env = dict(item.split(b"=", 1) for item in environ.split(b"\0") if b"=" in item)
    return int(env[b"RANK"]) if b"apps.bert.train" in cmdline and b"RANK" in env else None


def _wait_for(condition, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not condition():
        time.sleep(0.05)
    assert condition(), "timed out"


def _train(nodes: list[Node], folder: Path, argv: list[str], procs: int = 1) -> list[list[int]]:
    """Runs `argv` on both nodes to its end (which must be a success); the ranks that each node ran."""
    job = Job(nodes, folder, argv, procs)
    try:
        _wait_for(lambda: sum(map(len, job.ranks())) == 2 * procs or any(a.poll() is not None for a in job.agents))
        ranks = job.ranks()
        statuses = job.wait()
    finally:
        job.end()
    assert statuses == [0, 0], f"{job.stderr(0)[-3000:]}\n{job.stderr(1)[-3000:]}"
    return ranks


def _standalone(argv: list[str], procs: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
           "-m", "apps.bert.train", *argv]
    result = run_to_the_end(cmd)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("multinode") / "data")


def _same_losses(got: dict[int, dict], expected: dict[int, dict], steps) -> bool:
    return all(got[s]["loss"] == expected[s]["loss"] and got[s]["grad_norm"] == expected[s]["grad_norm"]
               for s in steps)


@pytest.mark.slow
def test_hybrid_shard_replicates_across_nodes_and_resumes_on_one(nodes, data, tmp_path):
    """2 nodes x 2 processes under hybrid_shard: shard groups of one node's processes (shard_size 0), so the
    replicate dimension spans the nodes. Its step-10 checkpoint resumes on one machine in the same 2 x 2 mesh and
    continues with the losses the two nodes logged."""
    dump, argv = tmp_path / "run", long_run_argv(data, tmp_path / "run", 20, "checkpoint.every=10",
                                                 "distributed.fsdp_type=hybrid_shard")
    assert _train(nodes, tmp_path / "job", argv, procs=2) == [[0, 1], [2, 3]]  # mesh rows [0, 1] and [2, 3]
    assert "on 4 process(es) (torchrun, cpu, hybrid_shard)" in (dump / "train.log").read_text()
    two_nodes = read_metrics(dump)
    resumed = tmp_path / "resumed"
    shutil.copytree(dump, resumed)
    shutil.rmtree(resumed / "checkpoints" / "0000000020")
    (resumed / "consolidated.pt").unlink()
    _standalone(long_run_argv(data, resumed, 20, "checkpoint.every=10", "distributed.fsdp_type=hybrid_shard",
                              "distributed.shard_size=2"), procs=4)
    assert f"resumed from {resumed / 'checkpoints' / '0000000010'}" in (resumed / "train.log").read_text()
    got = read_metrics(resumed)
    assert sorted(got) == list(range(1, 21)) and _same_losses(got, two_nodes, range(11, 21))


def test_a_lost_node_ends_the_job_in_one_line_and_a_new_job_resumes_exactly(nodes, data, long_run_on_two_processes,
                                                                              tmp_path):
    """One rank on each node, gloo over the veth. Node 1 (its agent and worker) is SIGKILLed mid-training: node 0's
    worker ends in one line (status 2) within seconds and its agent with it. The same job again, on both nodes,
    continues from the newest checkpoint: each step is in metrics.jsonl once, every step's loss and gradient norm,
    those the nodes trained before the kill and after it, those of the same job in two processes of one machine
    (gloo sums two ranks' values in either order to the same bits)."""
    dump = tmp_path / "run"
    checkpoints = CheckpointManager(dump / "checkpoints", CheckpointArgs())
    job = Job(nodes, tmp_path / "killed", long_run_argv(data, dump))
    try:
        _wait_for(lambda: checkpoints.latest() is not None or job.agents[0].poll() is not None)
        killed = time.time()
        end(job.agents[1])
        job.agents[0].wait(timeout=60)
        ended_after = time.time() - killed
    finally:
        job.end()
    err = job.stderr(0)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.fullmatch("error: rank 0 lost contact with another rank during .+: it stopped or "
                                             "failed .+", errors[0]), err
    assert "exitcode  : 2" in err and "]: Traceback" not in err  # torchrun's report of its worker's status
    assert job.agents[0].returncode != 0 and ended_after < 10, ended_after
    newest = checkpoints.latest()
    assert 5 <= int(newest.name) < LONG_RUN_STEPS

    assert _train(nodes, tmp_path / "again", long_run_argv(data, dump)) == [[0], [1]]
    log = (dump / "train.log").read_text()
    assert f"resumed from {newest}" in log and "on 2 process(es) (torchrun, cpu, full_shard)" in log
    lines = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    steps = [record["step"] for record in lines if "loss" in record]
    assert steps == list(range(1, LONG_RUN_STEPS + 1))
    assert _same_losses(read_metrics(dump), long_run_on_two_processes, steps)

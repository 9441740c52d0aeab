"""A real SLURM cluster on this one machine, for the tests of the SLURM launcher: munge, MariaDB, slurmdbd (so that
`sacct` answers), slurmctld and two compute nodes n1 and n2 (two slurmd daemons on their own ports, both names on
127.0.0.1), each with 2 stand-in GPUs. Everything lives in one temporary folder; clients find the cluster through
SLURM_CONF. Needs root and setup/install_slurm.sh."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("n1", "n2")
GPUS_PER_NODE = 2
BINARIES = ("munged", "mariadb-install-db", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "sacctmgr", "sbatch",
            "sacct", "squeue", "scontrol", "scancel", "sinfo", "srun")
# The daemons live in sbin, which a root shell's PATH may lack.
PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
# A variable every daemon (and so every job step, every job) inherits: `stop` kills whatever still carries it.
TAG = "LINGUA_SLURM_CLUSTER_TAG"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


def unavailable() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "the SLURM cluster needs root (its daemons run as root)"
    missing = [b for b in BINARIES if shutil.which(b, path=PATH) is None]
    if missing:
        return f"SLURM/munge/MariaDB binaries missing ({', '.join(missing)}): run setup/install_slurm.sh as root"
    return None


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free right now (held open together, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]


def resolve_node_names() -> None:
    """The jobs name their nodes n1 and n2 (SLURM_JOB_NODELIST, a rendezvous address): make both 127.0.0.1."""
    try:
        if all(socket.gethostbyname(n) == "127.0.0.1" for n in NODES):
            return
    except OSError:
        pass
    with open("/etc/hosts", "a") as hosts:
        hosts.write(f"127.0.0.1 {' '.join(NODES)}\n")


@dataclass
class SlurmCluster:
    """A running cluster: `env` is os.environ plus SLURM_CONF for subprocesses; the methods wrap the clients."""

    root: Path
    env: dict
    procs: list = field(default_factory=list, repr=False)

    def run(self, *cmd: str, timeout: float = 60) -> str:
        """A SLURM client command's stdout; raises RuntimeError (with its stderr) if it fails."""
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sacct(self, job_id, fields=("State", "ExitCode", "WorkDir")) -> list[dict]:
        """The accounting records of a job, one dict per job or array element (no steps), keyed by field and
        "JobID". State is its first word ("CANCELLED by 0" is CANCELLED)."""
        out = self.run("sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", ",".join(("JobID", *fields)))
        rows = [dict(zip(("JobID", *fields), line.split("|"))) for line in out.splitlines() if line]
        for row in rows:
            if "State" in row:
                row["State"] = row["State"].split(" ")[0]
        return rows

    def held(self, job_id) -> dict[str, str]:
        """The state of each element of the job (JobID -> state) in slurmctld; empty once it has forgotten the job
        (MinJobAge seconds after its end)."""
        done = subprocess.run(["squeue", "-h", "-j", str(job_id), "--states=all", "-o", "%i %T"], env=self.env,
                              capture_output=True, text=True, timeout=60)
        return dict(line.split() for line in done.stdout.splitlines()) if done.returncode == 0 else {}

    def states(self, job_id) -> list[str]:
        """The state of each element of the job: slurmctld's while it holds the job, else accounting's."""
        return list(self.held(job_id).values()) or [row["State"] for row in self.sacct(job_id, ("State",))]

    def wait_state(self, job_id, states, timeout: float = 60) -> str:
        """Waits until some element of the job is in one of `states` (a state or several; see `states`); that
        state."""
        wanted = {states} if isinstance(states, str) else set(states)

        def reached() -> str | None:
            return next((s for s in self.states(job_id) if s in wanted), None)

        return wait_for(f"job {job_id} in {sorted(wanted)}", reached, timeout, describe=lambda: self.held(job_id))

    def wait_final(self, job_id, timeout: float = 120) -> str:
        """Waits until every element of the job has ended and accounting has its final record, WorkDir included (a
        job that ends within seconds is first recorded without it); COMPLETED if every element completed, else the
        first other final state."""

        def ended() -> str | None:
            held = self.held(job_id)
            rows = {row["JobID"]: row for row in self.sacct(job_id, ("State", "WorkDir"))}
            if rows and set(held) <= set(rows) and all(s in FINAL_STATES for s in held.values()) \
                    and all(row["State"] in FINAL_STATES and row["WorkDir"] for row in rows.values()):
                return next((r["State"] for r in rows.values() if r["State"] != "COMPLETED"), "COMPLETED")
            return None

        return wait_for(f"job {job_id} ended", ended, timeout, describe=lambda: (self.held(job_id), self.sacct(job_id)))

    def queue(self) -> list[str]:
        """The ids of the jobs squeue lists (array elements as 12_3, pending rest as 12_[4-9])."""
        return self.run("squeue", "-h", "-o", "%i").split()

    def stop(self) -> None:
        """Cancels every job, stops every daemon, kills whatever they started and removes the folder."""
        with contextlib.suppress(Exception):  # a cluster that failed to start may have no slurmctld
            if jobs := self.queue():
                self.run("scancel", *jobs, timeout=10)
            deadline = time.time() + 15
            while self.queue() and time.time() < deadline:
                time.sleep(0.2)
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        kill_tagged(self.env[TAG])
        shutil.rmtree(self.root, ignore_errors=True)


def tagged(tag: str) -> set[int]:
    """The live processes carrying `tag` in their environment, and their descendants."""
    env, children = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            status = (entry / "status").read_text()
            if "\nState:\tZ" in status:
                continue
            ppid = int(status.split("\nPPid:\t")[1].split("\n")[0])
            children.setdefault(ppid, []).append(int(entry.name))
            env[int(entry.name)] = (entry / "environ").read_bytes().split(b"\0")
    found = [pid for pid, variables in env.items() if f"{TAG}={tag}".encode() in variables]
    for pid in found:
        found.extend(c for c in children.get(pid, ()) if c not in found)
    return set(found) - {os.getpid()}


def kill_tagged(tag: str, timeout: float = 30) -> None:
    """SIGKILLs every process `tagged` finds until none is left."""
    deadline = time.time() + timeout
    while (pids := tagged(tag)) and time.time() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def write_configs(root: Path, ports: dict) -> None:
    """slurm.conf, gres.conf and slurmdbd.conf under ROOT/etc; two stand-in GPUs per node under ROOT/dev/NODE."""
    host = socket.gethostname().split(".")[0]
    memory_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
    etc = root / "etc"
    nodes, gres = [], []
    for node in NODES:
        (root / "dev" / node).mkdir(parents=True)
        for i in range(GPUS_PER_NODE):
            # Slurm only stats the files (major 195 is NVIDIA's); the jobs read CUDA_VISIBLE_DEVICES.
            os.mknod(root / "dev" / node / f"nvidia{i}", 0o600 | 0o020000, os.makedev(195, i))
        nodes.append(f"NodeName={node} Port={ports[node]} CPUs=4 RealMemory={memory_mb} Gres=gpu:{GPUS_PER_NODE} "
                     "State=UNKNOWN")
        gres.append(f"NodeName={node} Name=gpu File={root}/dev/{node}/nvidia[0-{GPUS_PER_NODE - 1}]")
    munge_socket = f"{root}/run/munge.socket"
    (etc / "slurm.conf").write_text(f"""\
ClusterName=lingua
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports['slurmctld']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds (120 by default) before it may start again.
AuthInfo=socket={munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
# CPUs and GPUs are allocated, memory is only checked: both nodes declare all of the machine's.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
# Each node declares 4 CPUs on a machine that may have 2: slurmd registers what this file says.
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={ports['slurmdbd']}
# The munge socket for messages to slurmdbd (AuthInfo's serves those to slurmctld and slurmd).
AccountingStoragePass={munge_socket}
AccountingStorageTRES=gres/gpu
# Schedule at once (FIFO), kill a cancelled job's leftovers after 2 s; slurmctld forgets a job 5 s after its end
# (sacct still tells), requeue is allowed, and a node that comes back is usable again.
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0,sched_interval=1
MinJobAge=5
KillWait=2
JobRequeue=1
ReturnToService=2
MailProg=/bin/true
{chr(10).join(nodes)}
PartitionName=main Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
    (etc / "gres.conf").write_text("AutoDetect=off\n" + "\n".join(gres) + "\n")
    dbd = etc / "slurmdbd.conf"
    dbd.write_text(f"""\
AuthType=auth/munge
AuthInfo=socket={munge_socket}
DbdHost={host}
DbdAddr=127.0.0.1
DbdPort={ports['slurmdbd']}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports['mariadb']}
StorageUser=root
StorageLoc=slurm_acct_db
PidFile={root}/run/slurmdbd.pid
""")
    dbd.chmod(0o600)


def wait_for(what: str, ready, timeout: float, log: Path | None = None, describe=None):
    """Polls `ready()` until it returns something true, and returns that. An exception counts as not yet: a daemon
    still starting, or a client timing out on a loaded machine. On timeout, the error quotes the last exception,
    `describe()` and the end of `log`."""
    deadline, error = time.time() + timeout, None
    while time.time() < deadline:
        try:
            if result := ready():
                return result
        except Exception as e:
            error = e
        time.sleep(0.1)
    details = [f"last error: {error}"] if error else []
    if describe is not None:
        with contextlib.suppress(Exception):
            details.append(f"now: {describe()}")
    if log is not None and log.exists():
        details.append(log.read_text()[-3000:])
    raise TimeoutError("\n".join([f"{what}: not after {timeout} s", *details]))


def start_cluster() -> SlurmCluster:
    """Starts munge, MariaDB, slurmdbd, slurmctld and the two slurmd; returns once both nodes are idle."""
    resolve_node_names()
    root = Path(tempfile.mkdtemp(prefix="lingua-slurm-"))
    root.chmod(0o755)  # munged: its socket must be reachable by every user
    for sub in ("etc", "run", "log", "state", "mysql", *(f"spool/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True)
    names = ("slurmctld", "slurmdbd", "mariadb", *NODES)
    ports = dict(zip(names, free_ports(len(names))))
    write_configs(root, ports)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=PATH, SLURM_CONF=str(root / "etc" / "slurm.conf"), **{TAG: root.name})
    cluster = SlurmCluster(root, env)

    def daemon(name: str, *cmd: str) -> Path:
        """Starts a daemon in the foreground, its output in ROOT/log/NAME.log (the path returned)."""
        log = root / "log" / f"{name}.log"
        with open(log, "w") as out:
            cluster.procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, start_new_session=True))
        return log

    def listening(port: int) -> bool:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True

    def idle() -> bool:
        out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=10).split()
        return dict(zip(out[::2], out[1::2])) == {n: "idle" for n in NODES}

    try:
        key = root / "etc" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        munged = daemon("munged", "munged", "--foreground", "--force", f"--socket={root}/run/munge.socket",
                        f"--key-file={key}", f"--pid-file={root}/run/munged.pid",
                        f"--seed-file={root}/run/munged.seed")
        subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={root}/mysql", "--user=root",
                        "--skip-test-db"], env=env, check=True, capture_output=True)
        # No grant tables: the database is ours alone, on 127.0.0.1, and slurmdbd needs no password.
        mariadb = daemon("mariadb", "mariadbd", "--no-defaults", f"--datadir={root}/mysql", "--user=root",
                         "--bind-address=127.0.0.1", f"--port={ports['mariadb']}", f"--socket={root}/run/mysqld.sock",
                         f"--pid-file={root}/run/mysqld.pid", "--skip-grant-tables", "--skip-log-bin",
                         "--innodb-flush-log-at-trx-commit=0")
        wait_for("munged", lambda: (root / "run" / "munge.socket").exists(), 30, munged)
        wait_for("MariaDB", lambda: listening(ports["mariadb"]), 60, mariadb)
        slurmdbd = daemon("slurmdbd", "slurmdbd", "-D")
        wait_for("slurmdbd", lambda: cluster.run("sacctmgr", "-n", "list", "cluster", timeout=10) is not None, 60,
                 slurmdbd)
        cluster.run("sacctmgr", "-i", "add", "cluster", "lingua")
        slurmctld = daemon("slurmctld", "slurmctld", "-D", "-i")
        for node in NODES:
            daemon(f"slurmd-{node}", "slurmd", "-D", "-N", node)
        wait_for("the nodes", idle, 60, slurmctld)
    except BaseException:
        cluster.stop()
        raise
    return cluster

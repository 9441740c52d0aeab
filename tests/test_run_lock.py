"""The run lock holds across the hosts of a cluster file system, where `flock` may be local to each host: a lease
file that names its holder, renewed by a heartbeat, taken over only when its holder is certainly gone."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import end, read_metrics, start, tiny_argv

from apps.bert.train import APP as BERT
from lingua import train as loop
from lingua.errors import UserError
from lingua.host import process_start
from lingua.run_folder import RunFolder
from lingua.training.lifecycle import RunLock, lease_holder, lease_text

ANOTHER_HOST = {"host": "node7", "pid": "4242", "started": "12345", "machine": "another-boot/4026531836"}


def write_lease(dump: Path, age_s: float = 0, **holder) -> Path:
    """A lease as another process wrote it, last renewed `age_s` ago."""
    lease = dump / ".lock"
    lease.write_text(lease_text({**lease_holder(), **holder}))
    renewed = time.time() - age_s
    os.utime(lease, (renewed, renewed))
    return lease


def refusal(dump: Path, **lock_args) -> str:
    with pytest.raises(UserError) as refused:
        RunLock(RunFolder(dump), **lock_args).__enter__()
    return str(refused.value)


def test_a_live_lease_of_another_host_refuses_a_second_trainer_in_one_line(corpus, tmp_path, capsys):
    dump = tmp_path / "run"
    dump.mkdir()
    lease = write_lease(dump, **ANOTHER_HOST)
    before = lease.read_text()
    with pytest.raises(SystemExit) as exit_info:
        loop.main(BERT, tiny_argv(corpus, dump, steps=2))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {dump} is in use by a running training (pid 4242 on node7, lease {lease}"), err
    assert f"or delete {lease}" in err  # what to do if that holder is gone
    assert sorted(p.name for p in dump.iterdir()) == [".lock"] and lease.read_text() == before


def test_a_lease_is_taken_over_only_once_it_is_not_renewed_for_the_timeout(tmp_path):
    lease = write_lease(tmp_path, age_s=30, **ANOTHER_HOST)
    assert "(pid 4242 on node7" in refusal(tmp_path, stale_after_s=60)
    write_lease(tmp_path, age_s=90, **ANOTHER_HOST)
    with RunLock(RunFolder(tmp_path), stale_after_s=60):
        assert lease.read_text().startswith(f"pid {os.getpid()} on {os.uname().nodename} ")
    assert not lease.exists()  # released at the end: the next start needs no takeover


def test_a_lease_of_this_machine_is_taken_over_once_its_process_is_gone(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = {"pid": str(sleeper.pid), "started": process_start(sleeper.pid)}
        write_lease(tmp_path, age_s=3600, **alive)  # a stalled heartbeat, but the process provably runs
        assert f"(pid {sleeper.pid} on " in refusal(tmp_path)
        write_lease(tmp_path, **{**alive, "started": "1"})  # the pid reused by another process
        with RunLock(RunFolder(tmp_path)):
            pass
    finally:
        sleeper.kill()
        sleeper.wait()
    write_lease(tmp_path, **alive)  # the process has exited
    with RunLock(RunFolder(tmp_path)):
        assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} ")


def test_a_lease_of_an_earlier_round_of_the_same_job_is_taken_over(tmp_path, monkeypatch):
    """A node that died holding the lease: the job's next round (a requeue, a torchrun restart) may start on
    another host at once, since a round starts only once every process of the one before has stopped."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    write_lease(tmp_path, **ANOTHER_HOST)  # the same job and round: two commands in one allocation
    assert "(pid 4242 on node7" in refusal(tmp_path)
    write_lease(tmp_path, **ANOTHER_HOST, round="0")
    with RunLock(RunFolder(tmp_path)):
        pass


def test_a_lease_that_names_no_holder_is_judged_by_its_renewal_alone(tmp_path):
    lease = tmp_path / ".lock"
    lease.write_text("pid \u00b2 on node7\n")  # a digit that int() refuses: not a pid
    assert refusal(tmp_path, stale_after_s=60).startswith(f"{tmp_path} is in use by a running training (another "
                                                          f"process, lease {lease} renewed ")
    os.utime(lease, (time.time() - 90,) * 2)
    with RunLock(RunFolder(tmp_path), stale_after_s=60):
        assert lease.read_text().startswith(f"pid {os.getpid()} ")


def test_a_link_planted_at_the_lease_path_is_never_followed(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    dump = tmp_path / "run"
    dump.mkdir()
    (dump / ".lock").symlink_to(target)
    assert refusal(dump) == f"{dump / '.lock'} is a symbolic link, not a run lease: delete it (the run lock never " \
                            "follows one)"
    assert target.read_text() == "keep me\n"
    (dump / ".lock").unlink()
    (dump / ".lock").symlink_to(tmp_path / "created.txt")  # dangling: no file is created through it
    assert "is a symbolic link" in refusal(dump)
    assert not (tmp_path / "created.txt").exists()


def test_of_two_processes_racing_for_a_stale_lease_exactly_one_wins(tmp_path, monkeypatch):
    # On NFS mounted with local_lock=flock each host is granted its own flock: here both contenders are.
    monkeypatch.setattr("fcntl.flock", lambda *args: None, raising=False)
    for _ in range(20):
        write_lease(tmp_path, age_s=3600, **ANOTHER_HOST)
        start, results = threading.Barrier(2), []

        def contend():
            start.wait()
            lock = RunLock(RunFolder(tmp_path))
            try:
                results.append(lock.__enter__())
            except UserError as e:
                results.append(str(e))

        contenders = [threading.Thread(target=contend) for _ in range(2)]
        for thread in contenders:
            thread.start()
        for thread in contenders:
            thread.join()
        winners = [r for r in results if isinstance(r, RunLock)]
        assert len(winners) == 1, results
        assert "is in use by a running training" in next(r for r in results if isinstance(r, str))
        winners[0].__exit__(None, None, None)


def test_the_heartbeat_renews_the_lease_while_it_is_held(tmp_path):
    lease = tmp_path / ".lock"
    with RunLock(RunFolder(tmp_path), heartbeat_s=0.05):
        os.utime(lease, (time.time() - 3600,) * 2)
        deadline = time.time() + 5
        while time.time() < deadline and time.time() - lease.stat().st_mtime > 60:
            time.sleep(0.02)
        assert time.time() - lease.stat().st_mtime < 60
    assert not lease.exists()


def test_a_claim_left_by_a_killed_process_is_refused_in_one_line(tmp_path):
    lease = write_lease(tmp_path, age_s=3600, **ANOTHER_HOST)
    claim = tmp_path / f".lock.claim-{lease.stat().st_ino}"
    claim.touch()
    os.utime(claim, (time.time() - 60,) * 2)  # a takeover lasts milliseconds
    assert refusal(tmp_path) == f"{claim} was left by a process killed while taking over or releasing the run " \
                                f"lease {lease}: if no training runs in {tmp_path}, delete both files"


def _state(pid: int) -> str:
    return next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("State:"))


def _wait_until(condition, what: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def _files(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `folder` by path: its inode and bytes."""
    return {str(p.relative_to(folder)): (p.stat().st_ino, p.read_bytes()) for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_a_holder_that_stalled_past_the_takeover_writes_nothing_more(corpus, tmp_path):
    """Trainer A stops (SIGSTOP, as a stalled node) during step 8; once its lease is stale, B takes it over, resumes
    from checkpoint 5 and stops itself during its 8th step (step 13, checkpoint 10 saved). A resumes (SIGCONT):
    it exits with one line and writes not one byte into the run folder; B resumes and finishes the run."""
    dump, stale_s = tmp_path / "run", 2.0
    argv = tiny_argv(corpus, dump, steps=30) + ["checkpoint.every=5", "validation.every=0"]
    helper = [sys.executable, "tests/trainer_on_a_host_of_its_own.py", "0.2", str(stale_s), "8", "apps.bert.train"]
    a = start([*helper, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    b = None
    try:
        _wait_until(lambda: a.poll() is not None or _state(a.pid) == "T", "A stops itself")
        assert a.poll() is None, a.stderr.read()
        lease = dump / ".lock"
        _wait_until(lambda: time.time() - lease.stat().st_mtime > stale_s + 0.5, "A's lease is stale")
        b = start([*helper, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _wait_until(lambda: b.poll() is not None or _state(b.pid) == "T", "B stops itself")
        assert b.poll() is None, b.stderr.read()
        assert lease.read_text().startswith(f"pid {b.pid} ") and "resumed from" in (dump / "train.log").read_text()
        assert (dump / "checkpoints" / "0000000010").is_dir()
        before = _files(dump)

        os.kill(a.pid, signal.SIGCONT)
        _, err = a.communicate(timeout=180)
        assert a.returncode == 2, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith(f"error: the run lease {lease} was taken over by another process"), err
        assert _files(dump) == before  # no checkpoint, metrics or log byte, no file made or removed

        os.kill(b.pid, signal.SIGCONT)
        _, err = b.communicate(timeout=180)
        assert b.returncode == 0 and "took over the run lease" in err, err
    finally:
        for proc in (a, b):
            if proc is not None:
                end(proc)
    assert sorted(read_metrics(dump)) == list(range(1, 31))
    assert "was taken over" not in (dump / "train.log").read_text()  # A's error went to its own output only

"""The SLURM cluster fixture itself: two nodes with 2 GPUs each, accounting, multi-node steps, GPU binding and
requeue, so that a launcher test failing there points at the launcher."""

from tests.slurm_cluster import wait_for


def test_both_nodes_have_two_gpus(slurm_cluster):
    out = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N %G %t").split()
    assert out == ["n1", "gpu:2", "idle", "n2", "gpu:2", "idle"]


def test_batch_job_completes_and_is_accounted(slurm_cluster, tmp_path):
    job = slurm_cluster.run("sbatch", "--parsable", f"--chdir={tmp_path}", "-o", "out.txt", "--wrap",
                            "echo $SLURMD_NODENAME").strip()
    assert slurm_cluster.wait_final(job) == "COMPLETED"
    assert slurm_cluster.sacct(job) == [{"JobID": job, "State": "COMPLETED", "ExitCode": "0:0",
                                         "WorkDir": str(tmp_path)}]
    assert (tmp_path / "out.txt").read_text().strip() in ("n1", "n2")
    assert job not in slurm_cluster.queue()


def test_tasks_spread_over_nodes_or_share_one(slurm_cluster):
    assert sorted(slurm_cluster.run("srun", "-N2", "--ntasks-per-node=1", "printenv", "SLURMD_NODENAME").split()) \
        == ["n1", "n2"]
    assert len(set(slurm_cluster.run("srun", "-N1", "-n2", "printenv", "SLURMD_NODENAME").split())) == 1


def test_a_job_gets_the_gpus_of_its_node(slurm_cluster, tmp_path):
    job = slurm_cluster.run("sbatch", "--parsable", "--gpus-per-node=2", "-o", f"{tmp_path}/out.txt", "--wrap",
                            "echo $CUDA_VISIBLE_DEVICES").strip()
    assert slurm_cluster.wait_final(job) == "COMPLETED"
    assert (tmp_path / "out.txt").read_text().strip() == "0,1"


def test_array_elements_are_accounted_one_by_one(slurm_cluster, tmp_path):
    job = slurm_cluster.run("sbatch", "--parsable", "--array=0-3", "-c2", "-o", f"{tmp_path}/%a.txt", "--wrap",
                            "exit $((SLURM_ARRAY_TASK_ID == 2))").strip()
    assert slurm_cluster.wait_final(job) == "FAILED"
    rows = slurm_cluster.sacct(job, ("State", "ExitCode"))
    assert rows == [{"JobID": f"{job}_{i}", "State": "FAILED" if i == 2 else "COMPLETED",
                     "ExitCode": "1:0" if i == 2 else "0:0"} for i in range(4)]


def test_a_requeued_job_runs_again(slurm_cluster, tmp_path):
    out = tmp_path / "out.txt"
    job = slurm_cluster.run("sbatch", "--parsable", "--open-mode=append", "-o", str(out), "--wrap",
                            "echo started; sleep 120").strip()
    # the job's script has started, not only its allocation (RUNNING): requeued before its first line, the job's
    # first run would write nothing and the second could never be told apart from it
    wait_for("the first run", lambda: out.read_text().count("started") == 1, 60)
    slurm_cluster.run("scontrol", "requeue", job)
    wait_for("the second run", lambda: out.read_text().count("started") == 2, 60)  # after cred_expire seconds
    assert "Restarts=1" in slurm_cluster.run("scontrol", "show", "job", job)
    slurm_cluster.run("scancel", job)
    assert slurm_cluster.wait_final(job) == "CANCELLED"

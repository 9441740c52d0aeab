"""The layout of a run's folder (its dump_dir): the name of every file and folder the library writes there or reads
from it, and the rules over them. No other module spells these names (tests/test_run_folder.py checks).

    config.yaml          the config the run trains with (lingua/train.py writes it once the start has succeeded)
    metrics.jsonl        one record per logged step and evaluation (lingua/metrics.py)
    tensorboard/         the same records' numbers as TensorBoard event files, one file per process that trained
                         the run (logging.tensorboard=true; lingua/metrics.py)
    train.log            every rank's log
    checkpoints/         the checkpoints; inside it, the layout of each step (NNNNNNNNNN/ with params.json,
                         train_state_NNNNN.json, manifest.json) is lingua/checkpoint/store.py's CheckpointManager's
    consolidated.pt      the final weights in one file, with the app and the config: the run is finished
    consolidated_ema.pt  the final weights' average (ema.decay), as consolidated.pt, written just before it
    best.pt, best.json   the weights and the validation record of the best evaluation (validation.keep_best)
    .lock                the run's lease (lingua/training/lifecycle.py's RunLock)
    submitted.yaml       the config stool submitted (lingua/stool.py)
    job.json             the record of the job that runs it (lingua/jobs/launcher.py)
    submitit/, code/     submitit's files of its job and the code snapshots its jobs run (a run submitted alone;
                         the runs of a sweep share the sweep folder's; a local sweep's submitit/ holds
                         local_controllers.log, the stderr of submitit's local job controllers)
    glue_eval/, embedding_eval/, mteb_eval/
                         the evaluations of its checkpoints (tools/eval), one folder per checkpoint, each with a
                         results.json; glue_eval/cache/ holds the probes' cached features

A sweep's folder (sweep.json, kept by lingua/stool.py) and a pipeline's (pipeline.json, stages/STAGE/ with done.json,
started.json, failed.json and job.json, kept by lingua/jobs/pipeline.py and lingua/jobs/pipeline_stage.py) hold code/
and submitit/ too; their names are here as well.
"""

from dataclasses import dataclass
from pathlib import Path

from lingua.errors import UserError

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
LOG = "train.log"
CHECKPOINTS = "checkpoints"
CONSOLIDATED = "consolidated.pt"
CONSOLIDATED_EMA = "consolidated_ema.pt"
BEST_WEIGHTS = "best.pt"
BEST_RECORD = "best.json"
LOCK = ".lock"
SUBMITTED = "submitted.yaml"
JOB_RECORD = "job.json"
SUBMITIT = "submitit"
LOCAL_CONTROLLERS_LOG = "local_controllers.log"  # in a submitit folder: what submitit's local controllers print
CODE = "code"
RESULTS = "results.json"  # what an evaluation writes into its folder
EVALUATIONS = ("glue", "embedding", "mteb")  # the tools/eval commands that file their results with the run
FEATURE_CACHE = "cache"
SWEEP_RECORD = "sweep.json"  # a sweep's folder: what was swept
PIPELINE_RECORD = "pipeline.json"  # a pipeline's folder: its stages as launched
STAGES = "stages"  # a pipeline's folder: one folder per stage, holding the stage's records
STAGE_DONE, STAGE_STARTED, STAGE_FAILED = "done.json", "started.json", "failed.json"


@dataclass(frozen=True)
class RunFolder:
    """The files and folders of the run whose dump_dir is `root`."""

    root: Path

    @classmethod
    def of(cls, path: str | Path) -> "RunFolder":
        """The run that holds `path`: a checkpoint folder in a run's checkpoints/, a weights file in a run's folder
        (consolidated.pt, best.pt), or a run's folder itself."""
        path = Path(path)
        if path.parent.name == CHECKPOINTS:
            return cls(path.parent.parent)
        return cls(path.parent if path.is_file() else path)

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD

    @property
    def log(self) -> Path:
        return self.root / LOG

    def log_text(self) -> str:
        """The log's text, "" for a run that has none yet."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def consolidated(self) -> Path:
        return self.root / CONSOLIDATED

    @property
    def consolidated_ema(self) -> Path:
        return self.root / CONSOLIDATED_EMA

    @property
    def best_weights(self) -> Path:
        return self.root / BEST_WEIGHTS

    @property
    def best_record(self) -> Path:
        return self.root / BEST_RECORD

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    @property
    def submitted(self) -> Path:
        return self.root / SUBMITTED

    @property
    def finished(self) -> bool:
        """Whether the run trained to its last step: its consolidated weights are there."""
        return self.consolidated.exists()

    def evaluations(self, kind: str) -> Path:
        """The folder of the run's `kind` evaluations (one of EVALUATIONS)."""
        if kind not in EVALUATIONS:
            raise ValueError(f"unknown evaluation {kind!r}")
        return self.root / f"{kind}_eval"

    def evaluation(self, kind: str, checkpoint: Path) -> Path:
        """Where the `kind` evaluation of one of the run's checkpoints is filed: named after the checkpoint (refused if
        a link would take it out of the run folder: `writable`)."""
        return self.writable(self.evaluations(kind) / checkpoint.name.removesuffix(".pt"))

    def evaluation_results(self, kind: str) -> list[Path]:
        """The results file of each of the run's `kind` evaluations, by path."""
        return sorted(self.evaluations(kind).glob(f"*/{RESULTS}"))

    @property
    def feature_cache(self) -> Path:
        """The GLUE probes' cached features of the run's checkpoints (refused behind a link: `writable`)."""
        return self.writable(self.evaluations("glue") / FEATURE_CACHE)

    def writable(self, path: Path) -> Path:
        """`path`, a folder the library writes into inside the run folder, once neither it nor any folder between
        the run folder and it is a symbolic link (dangling or not): a write through one would land outside the run
        folder, in another run's, say, and a prune there would delete that run's files. Else one line, before
        anything is written. (A link at a file the library writes is lingua.files.safe.atomic_write's to refuse.)"""
        at = self.root
        for name in path.relative_to(self.root).parts:
            at = at / name
            if at.is_symlink():
                elsewhere = "; to keep checkpoints on another disk, put the whole dump_dir there" \
                    if at == self.checkpoints else ""
                raise UserError(f"{at} is a symbolic link, which the library never writes through (delete it"
                                f"{elsewhere})")
        return path

"""A checkpoint names the app that rebuilds its model, and a checkpoint from elsewhere names what it likes: the
commands that open one build only this code's apps, or the one the user names with app=; any other name is refused
in one line, before anything is imported. The two attacks as they were found: `"app": "this"` in a copied
checkpoint (its manifest size updated), and a train.py placed inside the received run folder itself, named
`"app": "dump.recv"` from the folder the command runs in."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ENV, offline_data, tiny_argv, write_corpus

from apps.contrastive import train as contrastive
from apps.crossbert.inspect import main as inspect_main
from apps.crossbert.train import APP as CROSSBERT
from apps.finetune import train as finetune
from lingua import train as train_command
from lingua.app import checkpoint_app, load_model
from lingua.args import load_config
from lingua.checkpoint.store import MANIFEST, PARAMS, Checkpoint
from lingua.errors import UserError
from lingua.export.consolidate import main as consolidate_main
from lingua.export.embedder import load_embedder
from lingua.export.hf_folder import main as export_main
from lingua.run_folder import RunFolder
from tests.test_contrastive import contrastive_argv, write_triplets
from tests.test_finetune import finetune_argv
from tools.eval import embeddings as embeddings_command
from tools.eval import glue as glue_command
from tools.eval import mteb as mteb_command
from tools.finetune.table import paper_app

GLUE = Path(__file__).parent / "fixtures" / "glue"
ZEN = "Beautiful is better than ugly"
BROUGHT_ALONG = '''
from dataclasses import replace
from pathlib import Path

from apps.crossbert.train import APP as CROSSBERT

Path({marker!r}).write_text("ran")
APP = replace(CROSSBERT, name="dump.recv")  # what the sender's train.py would be: an app, and code that runs
'''


def _name_app(run: Path, app: str) -> None:
    """Every checkpoint of the run and its consolidated.pt name `app`; the manifest's sizes follow, as a crafted
    folder's would."""
    for checkpoint in RunFolder(run).checkpoints.iterdir():
        params = json.loads((checkpoint / PARAMS).read_text())
        (checkpoint / PARAMS).write_text(json.dumps({**params, "app": app}))
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        (checkpoint / MANIFEST).write_text(json.dumps({**manifest, PARAMS: (checkpoint / PARAMS).stat().st_size}))
    consolidated = RunFolder(run).consolidated
    torch.save({**torch.load(consolidated, weights_only=True), "app": app}, consolidated)


@pytest.fixture
def received(tiny_crossbert, tmp_path, monkeypatch):
    """A function: the pre-trained run as received, naming `app`, at dump/recv under the folder the command runs in
    (which, as for `python -m`, is on sys.path), with the sender's train.py inside it; the modules it could import
    are forgotten afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "dump" / "recv"

    def receive(app: str) -> Path:
        shutil.copytree(tiny_crossbert, run)
        _name_app(run, app)
        (run / "train.py").write_text(BROUGHT_ALONG.format(marker=str(tmp_path / "ran")))
        return run

    forget = [name for name in sys.modules if name in ("this", "dump") or name.startswith("dump.")]
    for name in forget:
        del sys.modules[name]
    yield receive
    for name in [name for name in sys.modules if name in ("this", "dump") or name.startswith("dump.")]:
        del sys.modules[name]


def _imported(tmp_path: Path) -> list[str]:
    """What shows that the checkpoint's app ran: the marker its train.py writes, the modules it names."""
    return [*(["marker"] if (tmp_path / "ran").exists() else []),
            *(name for name in sys.modules if name in ("this", "dump") or name.startswith("dump."))]


def _refusal(app: str) -> str:
    return (f"was saved by app '{app}', which is not one of this code's apps (bert, contrastive, crossbert, electra, "
            f"finetune): nothing was imported; if you trust it, run again with app={app}")


# Each command that opens a checkpoint: (argv of its main for the run `run` in `tmp`), in-process.
COMMANDS = {
    "export": lambda run, tmp: export_main([f"ckpt={run}", f"out={tmp / 'hf'}"]),
    "export_consolidated": lambda run, tmp: export_main([f"ckpt={RunFolder(run).consolidated}", f"out={tmp / 'hf'}"]),
    "consolidate": lambda run, tmp: consolidate_main(["consolidate", str(run), str(tmp / "out.pt")]),
    "probe": lambda run, tmp: glue_command.main([f"ckpt={run}", f"data={GLUE}", "tasks=rte", "probes=linear"]),
    "embeddings": lambda run, tmp: embeddings_command.main([f"ckpt={run}", f"retrieval={tmp / 'beir'}"]),
    "mteb": lambda run, tmp: mteb_command.main([f"ckpt={run}", f"offline={offline_data(tmp / 'shared')}",
                                                "tasks=STSBOffline", f"out={tmp / 'mteb'}"]),
    "inspect": lambda run, tmp: inspect_main([f"ckpt={run}", "n_sequences=4"]),
    "contrastive_init_from": lambda run, tmp: train_command.main(contrastive.APP, contrastive_argv(
        write_triplets(tmp / "t.jsonl", 16), tmp / "contrastive", run, 1)),
    "contrastive_init_from_mean_pooler": lambda run, tmp: train_command.main(contrastive.APP, contrastive_argv(
        write_triplets(tmp / "t.jsonl", 16), tmp / "contrastive", run, 1, "model.pooler.kind=mean")),
    "finetune_init_from": lambda run, tmp: train_command.main(finetune.APP, finetune_argv(tmp / "ft", run, "rte")),
}


@pytest.mark.parametrize("app", ["this", "dump.recv"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_checkpoint_naming_an_app_of_elsewhere_is_refused_unimported(received, tmp_path, capsys, command, app):
    run = received(app)
    with pytest.raises(SystemExit) as exited:
        COMMANDS[command](run, tmp_path)
    out, err = capsys.readouterr()
    assert exited.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert f"was saved by app '{app}', which is" in err and "nothing was imported" in err, err
    assert ZEN not in out and _imported(tmp_path) == []


@pytest.mark.parametrize("app", ["this", "dump.recv"])
def test_the_library_calls_refuse_it_too(received, tmp_path, app):
    run = received(app)
    for call in (lambda: load_model(run), lambda: load_embedder(str(run)),
                 lambda: checkpoint_app(Checkpoint.open(run))):
        with pytest.raises(UserError) as refused:
            call()
        assert str(refused.value) == f"checkpoint {Checkpoint.resolve(run)} {_refusal(app)}"
    assert paper_app(str(run)) is None  # tools.finetune.table reads the app's name, and imports no app it names
    assert _imported(tmp_path) == []


def test_a_run_started_from_it_is_refused_before_anything_is_written(received, tmp_path):
    run = received("dump.recv")
    argv = contrastive_argv(write_triplets(tmp_path / "t.jsonl", 16), tmp_path / "contrastive", run, 1)
    with pytest.raises(UserError) as refused:
        train_command.train(contrastive.APP, load_config(contrastive.APP.args_cls, argv))
    assert str(refused.value) == (
        f"init_from: checkpoint {Checkpoint.resolve(run)} was saved by app 'dump.recv', which is neither one of this "
        "code's apps (bert, contrastive, crossbert, electra, finetune) nor apps.contrastive.train: nothing was "
        "imported")
    assert not (tmp_path / "contrastive").exists() and _imported(tmp_path) == []


def test_a_pretraining_run_started_from_it_takes_its_weights_and_imports_nothing(received, tmp_path):
    """A pre-training app loads init_from's weights into its own model as it is: the app it names builds nothing."""
    run = received("dump.recv")
    argv = tiny_argv(write_corpus(tmp_path / "data", 50), tmp_path / "next", 1) + ["validation.every=0",
                                                                                  f"init_from={run}"]
    train_command.train(CROSSBERT, load_config(CROSSBERT.args_cls, argv))
    assert _imported(tmp_path) == []


ALLOWED = {
    "export": lambda run, tmp: export_main([f"ckpt={run}", f"out={tmp / 'hf'}", "app=dump.recv"]),
    "consolidate": lambda run, tmp: consolidate_main(["consolidate", str(run), str(tmp / "out.pt"), "app=dump.recv"]),
    "probe": lambda run, tmp: glue_command.main([f"ckpt={run}", f"data={GLUE}", "tasks=rte", "probes=linear",
                                                 "app=dump.recv"]),
    "inspect": lambda run, tmp: inspect_main([f"ckpt={run}", "n_sequences=4", "app=dump.recv"]),
}


@pytest.mark.parametrize("command", ALLOWED)
def test_the_app_named_on_the_command_line_opens_it(received, tmp_path, capsys, command):
    run = received("dump.recv")
    ALLOWED[command](run, tmp_path)
    assert "error" not in capsys.readouterr().err
    assert (tmp_path / "ran").exists()  # the user trusted the sender's code: it ran


def test_the_app_named_in_a_library_call_builds_it(received, tmp_path):
    run = received("dump.recv")
    model, config, _ = load_model(run, app="dump.recv")
    assert type(model).__name__ == "CrossBert" and config.model.encoder.dim == 32
    assert load_embedder(str(run), app="dump.recv").dim == 32


def test_another_named_app_does_not_allow_it(received, tmp_path):
    run = received("dump.recv")
    with pytest.raises(UserError, match="neither one of this code's apps .* nor bert: nothing was imported; if you "
                                        "trust it, run again with app=dump.recv$"):
        load_model(run, app="bert")
    assert _imported(tmp_path) == []


def test_as_found_the_export_of_a_copied_checkpoint_does_not_print_the_zen_of_python(received, tmp_path):
    run = received("this")
    done = subprocess.run([sys.executable, "-m", "lingua.export", f"ckpt={run}", f"out={tmp_path / 'hf'}"],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and ZEN not in done.stdout, done.stdout + done.stderr
    assert done.stderr.splitlines() == [f"error: checkpoint {Checkpoint.resolve(run)} {_refusal('this')}"]


def test_as_found_consolidating_a_received_folder_does_not_run_its_train_py(received, tmp_path):
    run = received("dump.recv")
    done = subprocess.run([sys.executable, "-m", "lingua.checkpoint", "consolidate", "dump/recv", "out.pt"],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and not (tmp_path / "ran").exists(), done.stderr
    assert len(done.stderr.splitlines()) == 1 and "app 'dump.recv'" in done.stderr
    assert not (tmp_path / "out.pt").exists() and run.exists()


def test_an_app_name_with_a_newline_and_terminal_escapes_is_quoted_and_not_offered(received, tmp_path, capsys):
    """A name is text the sender chose: raw, it broke the one line and wrote its own line after it."""
    app = "x\n\x1b[2Jerror: none, all is well"
    run = received(app)
    with pytest.raises(SystemExit) as exited:
        COMMANDS["export"](run, tmp_path)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "\x1b" not in err, err
    assert err.rstrip("\n").endswith(f"was saved by app {app!r}, which is not one of this code's apps (bert, "
                                     "contrastive, crossbert, electra, finetune): nothing was imported"), err
    assert "app=" not in err and _imported(tmp_path) == []

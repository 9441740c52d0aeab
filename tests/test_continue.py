"""A new run continuing another run's training (`continue_from`): WSD decay branches and phases."""

import hashlib

import pytest
import yaml
from conftest import read_metrics, tiny_argv, write_corpus

from apps.bert.train import APP
from lingua.args import load_config
from lingua.errors import UserError
from lingua.train import train

WSD = ["optim.schedule=wsd", "optim.warmup=4"]
STABLE = [*WSD, "optim.decay_fraction=0", "checkpoint.every=10", "checkpoint.keep=0", "ema.decay=0.9"]


def run(argv):
    return train(APP, load_config(APP.args_cls, argv))


def folder_digest(folder) -> str:
    """The names, sizes and contents of every file under `folder`."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(folder)}:{path.stat().st_size}".encode() + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def stable(tmp_path_factory):
    """(the tiny corpus, a 20-step stable WSD run on it with checkpoints at steps 10 and 20)."""
    root = tmp_path_factory.mktemp("stable")
    corpus = write_corpus(root / "data")
    run(tiny_argv(corpus, root / "stable", steps=20) + STABLE)
    return corpus, root / "stable"


def test_a_decay_branch_equals_a_run_never_interrupted(stable, tmp_path):
    """A branch from the stable run's step-10 checkpoint, decaying over 6 steps, trains step for step as the run of 16
    steps with that schedule from the start; the parent is not written; tokens and FLOPs count from its start."""
    corpus, parent = stable
    before = folder_digest(parent)
    branch, whole = tmp_path / "branch", tmp_path / "whole"
    decay = [*WSD, "optim.decay_steps=6"]
    run(tiny_argv(corpus, branch, steps=16) + decay + [f"continue_from={parent}/checkpoints/0000000010"])
    run(tiny_argv(corpus, whole, steps=16) + decay)
    got, expected = read_metrics(branch), read_metrics(whole)
    assert sorted(got) == list(range(11, 17))
    for step in got:
        for key in ("loss", "lr", "data_tokens", "compute_flops"):
            assert got[step][key] == expected[step][key], (step, key)
    assert got[11]["lr"] == 3e-3 and got[16]["lr"] < got[12]["lr"] < 3e-3  # from the stable value into the decay
    config = yaml.safe_load((branch / "config.yaml").read_text())
    assert config["continue_from"] == str((parent / "checkpoints" / "0000000010").resolve())
    assert config["phase"] == "branch"
    assert folder_digest(parent) == before
    run(tiny_argv(corpus, branch, steps=16) + decay + [f"continue_from={parent}"])  # the same command: finished
    assert yaml.safe_load((branch / "config.yaml").read_text())["continue_from"] == config["continue_from"]


def test_a_branch_carries_the_weights_average_on(stable, tmp_path):
    """The stable run's average of the weights goes on in the branch: at the end it equals, bit for bit, that of the
    run never interrupted."""
    import torch

    corpus, parent = stable
    decay = [*WSD, "optim.decay_steps=6", "ema.decay=0.9"]
    run(tiny_argv(corpus, tmp_path / "branch", steps=16) + decay + [f"continue_from={parent}/checkpoints/0000000010"])
    run(tiny_argv(corpus, tmp_path / "whole", steps=16) + decay)
    branch, whole = (torch.load(tmp_path / name / "consolidated_ema.pt", weights_only=True)["model"]
                     for name in ("branch", "whole"))
    assert branch.keys() == whole.keys() and all(torch.equal(branch[k], whole[k]) for k in whole)


def test_a_phase_grows_the_context_and_the_export_carries_it(stable, tmp_path, capsys):
    """Context extension: twice the sequence length with the model's max_seqlen and rope_theta; the data position
    carries over (the same sources); the parent's compute is counted at its length, the phase's at the new one; the
    export's length is the phase's."""
    from lingua.export.embedder import load_embedder
    from lingua.export.hf_folder import hf_config

    corpus, parent = stable
    longer = tmp_path / "longer"
    run(tiny_argv(corpus, longer, steps=24) + [*WSD, "optim.decay_steps=4", f"continue_from={parent}",
                                               "data.seq_len=64", "model.encoder.max_seqlen=64",
                                               "model.encoder.rope_theta=20000", "data.batch_size=4"])
    config = yaml.safe_load((longer / "config.yaml").read_text())
    assert config["phase"] == "phase" and config["continue_from"].endswith("0000000020")
    got, before = read_metrics(longer), read_metrics(parent)[20]
    assert sorted(got) == list(range(21, 25))
    step_tokens = got[21]["data_tokens"] - before["data_tokens"]
    per_token = (got[22]["compute_flops"] - got[21]["compute_flops"]) / step_tokens
    assert per_token > before["compute_flops"] / before["data_tokens"]  # the longer rows' attention costs more
    assert got[21]["compute_flops"] == pytest.approx(before["compute_flops"] + step_tokens * per_token, rel=1e-12)
    assert "the data position starts afresh" not in capsys.readouterr().out
    assert hf_config(load_embedder(str(longer)), None, None, {})["max_position_embeddings"] == 64


def test_a_phase_on_other_sources_restarts_the_data_position_in_one_line(stable, tmp_path, capsys):
    corpus, parent = stable
    other = write_corpus(tmp_path / "other", seed=1)
    run(tiny_argv(other, tmp_path / "mix", steps=22) + [*WSD, "optim.decay_steps=2", f"continue_from={parent}",
                                                        "phase=new_mix"])
    assert "the data position starts afresh: data.root_dir changed\n" in capsys.readouterr().out
    assert yaml.safe_load((tmp_path / "mix" / "config.yaml").read_text())["phase"] == "new_mix"


@pytest.mark.parametrize("change, refusal", [
    (["model.encoder.dim=64"], "cannot grow from \\(model.encoder.dim 32 -> 64\\): a continued run may change only"),
    (["data.seq_len=64"], "data.seq_len \\(64\\) exceeds model.encoder.max_seqlen \\(32\\)"),
    (["steps=10"], "is at step 10: this run's steps \\(10\\) must be more"),
])
def test_a_phase_refuses_what_the_model_cannot_grow_into_in_one_line(stable, tmp_path, change, refusal):
    corpus, parent = stable
    dump = tmp_path / "refused"
    with pytest.raises(UserError, match=refusal) as refused:
        run(tiny_argv(corpus, dump, steps=12) + [f"continue_from={parent}/checkpoints/0000000010", *change])
    assert "\n" not in str(refused.value) and not (dump / "checkpoints").exists()


def test_continue_from_refuses_weights_only_and_init_from(stable, tmp_path):
    corpus, parent = stable
    with pytest.raises(UserError, match="holds weights only"):
        run(tiny_argv(corpus, tmp_path / "a", steps=30) + [f"continue_from={parent}/consolidated.pt"])
    with pytest.raises(UserError, match="continue_from.*exclude each other"):
        run(tiny_argv(corpus, tmp_path / "b", steps=30) + [f"continue_from={parent}", f"init_from={parent}"])


def test_continue_from_refuses_the_parents_own_folder_and_a_folder_holding_another_run(stable, tmp_path):
    """Naming the parent's folder as the dump_dir would resume the parent and write into it; a folder holding another
    run would resume that one: both refused in one line, the parent untouched."""
    corpus, parent = stable
    before = folder_digest(parent)
    with pytest.raises(UserError, match="in this run's own folder"):
        run(tiny_argv(corpus, parent, steps=26) + [*WSD, "optim.decay_steps=6",
                                                    f"continue_from={parent}/checkpoints/0000000010"])
    assert folder_digest(parent) == before
    other = tmp_path / "other"
    run(tiny_argv(corpus, other, steps=2) + WSD[1:])
    with pytest.raises(UserError, match="holds a run of its own, not one continued from"):
        run(tiny_argv(corpus, other, steps=16) + [f"continue_from={parent}"])


def test_a_continued_run_resumed_keeps_its_parent_and_refuses_another_checkpoint(stable, tmp_path):
    """Resumed by a command without continue_from, a branch still names its parent (the scaling tools read the family
    by it); named with another checkpoint of that parent, it is refused in one line rather than resumed."""
    corpus, parent = stable
    branch = tmp_path / "branch"
    run(tiny_argv(corpus, branch, steps=12) + [*WSD, "optim.decay_steps=2",
                                                f"continue_from={parent}/checkpoints/0000000010"])
    run(tiny_argv(corpus, branch, steps=14) + [*WSD, "optim.decay_steps=2"])
    config = yaml.safe_load((branch / "config.yaml").read_text())
    assert config["continue_from"].endswith("0000000010") and config["phase"] == "branch"
    with pytest.raises(UserError, match="holds a run continued from .*0000000010, not one continued from"):
        run(tiny_argv(corpus, branch, steps=16) + [*WSD, f"continue_from={parent}/checkpoints/0000000020"])


def test_a_data_setting_change_is_one_of_substance_not_of_spelling(tmp_path, monkeypatch):
    """The same folder however it is written (stool makes root_dir absolute), the same tokenizer wherever its file
    lies: neither restarts the data position nor makes a branch a phase."""
    from lingua.training.resume import data_position_changes, data_setting_changes

    monkeypatch.chdir(tmp_path)
    gpt2 = {"name": "gpt2", "path": "", "sha256": ""}
    old = {"root_dir": "data", "seed": 1, "tokenizer": gpt2}
    assert data_setting_changes(old, {**old, "root_dir": str(tmp_path / "data"),
                                      "tokenizer": {**gpt2, "path": "/elsewhere/r50k_base.tiktoken"}}) == []
    assert data_position_changes({"root_dir": "data"}, {"root_dir": "other"}) == ["data.root_dir"]
    hf = {"name": "hf", "path": "a/tokenizer.json", "sha256": "1"}
    assert data_setting_changes({"tokenizer": hf}, {"tokenizer": {**hf, "sha256": "2"}}) == ["data.tokenizer"]


def test_a_phase_with_another_mask_ratio_keeps_the_data_position(stable, tmp_path, capsys):
    corpus, parent = stable
    run(tiny_argv(corpus, tmp_path / "ratio", steps=22) + [f"continue_from={parent}", "model.mask_ratio=0.3"])
    out = capsys.readouterr().out
    assert "continuing with changed settings: " in out and "model.mask_ratio 0.2 -> 0.3" in out
    assert "the data position starts afresh" not in out
    assert yaml.safe_load((tmp_path / "ratio" / "config.yaml").read_text())["phase"] == "phase"

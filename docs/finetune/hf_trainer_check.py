"""This library's GLUE fine-tuning against HuggingFace's `Trainer` on the same exported model, same data, learning
rate, epochs, batch, pooling and seeds: the two should agree within seed noise.

    python docs/finetune/hf_trainer_check.py ckpt=dump/crossbert_debug glue=../shared/data/glue out=dump/hf_check \
        [tasks=rte,sst2] [seeds=0,1,2] [epochs=2] [lr=1e-4] [sst2_train=3000]

Exports the checkpoint (`python -m lingua.export`), then per task and seed runs `python -m apps.finetune.train` and
a `Trainer` on `AutoModelForSequenceClassification.from_pretrained(EXPORT, trust_remote_code=True)` (its data read
with `datasets`' CSV reader and encoded by the exported tokenizer, not by this library). Both: AdamW (betas 0.9/0.98,
eps 1e-6, no weight decay: the two libraries exempt different parameters from it), a 6 % linear warm-up then a
linear decay, batch 32, mean pooling, the dev set scored after each epoch and the best epoch reported. SST-2 is cut
to its first `sst2_train` training examples (the whole dev set is kept) to fit a CPU. Writes OUT/results.md.
"""

import json
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lingua.args import command_line, load_config  # noqa: E402
from lingua.run_folder import RunFolder  # noqa: E402

LABELS = {"rte": ["entailment", "not_entailment"], "sst2": ["0", "1"]}
COLUMNS = {"rte": ("sentence1", "sentence2"), "sst2": ("sentence",)}
FOLDERS = {"rte": "RTE", "sst2": "SST-2"}


@dataclass
class CheckArgs:
    ckpt: str = ""  # the pre-trained run
    glue: str = ""  # the GLUE TSV folder
    out: str = "dump/hf_check"
    tasks: list[str] = field(default_factory=lambda: ["rte", "sst2"])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    epochs: int = 2
    lr: float = 1e-4
    batch_size: int = 32
    max_len: int = 128
    sst2_train: int = 3000


def subset_glue(args: CheckArgs, folder: Path) -> None:
    """The tasks' TSV files, SST-2's train split cut to its first examples."""
    for task in args.tasks:
        source, target = Path(args.glue) / FOLDERS[task], folder / FOLDERS[task]
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / "dev.tsv", target / "dev.tsv")
        lines = (source / "train.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
        keep = args.sst2_train + 1 if task == "sst2" else len(lines)
        (target / "train.tsv").write_text("".join(lines[:keep]), encoding="utf-8")


def ours(args: CheckArgs, glue: Path, task: str, seed: int, out: Path) -> float:
    dump = out / f"ours_{task}_seed{seed}"
    subprocess.run([sys.executable, "-m", "apps.finetune.train", "config=apps/finetune/configs/debug.yaml",
                    f"init_from={args.ckpt}", f"data.path={glue}", f"data.task={task}", f"seed={seed}",
                    f"dump_dir={dump}", f"epochs={args.epochs}", f"optim.lr={args.lr}", "optim.weight_decay=0",
                    f"data.batch_size={args.batch_size}", f"data.seq_len={args.max_len}", "model.pooling=mean"],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return json.loads(RunFolder(dump).best_record.read_text())["val/score"]


def theirs(args: CheckArgs, export: Path, glue: Path, task: str, seed: int, out: Path) -> float:
    import datasets
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(export, trust_remote_code=True)
    files = {split: str(glue / FOLDERS[task] / f"{split}.tsv") for split in ("train", "dev")}
    data = datasets.load_dataset("csv", data_files=files, delimiter="\t", quoting=3, keep_default_na=False)
    columns = COLUMNS[task]

    def encode(batch):
        encoded = tokenizer(*[batch[c] for c in columns], truncation=True, max_length=args.max_len)
        encoded["labels"] = [LABELS[task].index(str(label)) for label in batch["label"]]
        return encoded

    data = data.map(encode, batched=True, remove_columns=data["train"].column_names)
    model = AutoModelForSequenceClassification.from_pretrained(export, num_labels=len(LABELS[task]),
                                                               trust_remote_code=True, classifier_pooling="mean")
    training = TrainingArguments(
        output_dir=str(out / f"theirs_{task}_seed{seed}"), learning_rate=args.lr, num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=64, warmup_steps=0.06,
        lr_scheduler_type="linear", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-6,
        max_grad_norm=1.0, seed=seed, eval_strategy="epoch", save_strategy="no", logging_strategy="epoch",
        report_to=[], use_cpu=True, dataloader_drop_last=True, disable_tqdm=True)

    def accuracy(prediction):
        return {"accuracy": float((np.argmax(prediction.predictions, 1) == prediction.label_ids).mean() * 100)}

    trainer = Trainer(model=model, args=training, train_dataset=data["train"], eval_dataset=data["dev"],
                      processing_class=tokenizer, compute_metrics=accuracy)
    trainer.train()
    return max(r["eval_accuracy"] for r in trainer.state.log_history if "eval_accuracy" in r)


def main() -> None:
    with command_line(__doc__):
        args = load_config(CheckArgs, sys.argv[1:])
    out = Path(args.out).resolve()
    glue, export = out / "glue", out / "export"
    subset_glue(args, glue)
    subprocess.run([sys.executable, "-m", "lingua.export", f"ckpt={args.ckpt}", f"out={export}"], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)
    lines = [f"Fine-tuning {args.ckpt}: this library against HF Trainer, lr {args.lr:g}, {args.epochs} epochs, "
             f"batch {args.batch_size}, mean pooling; dev accuracy of the best epoch, in %", "",
             "| task | seed | apps.finetune | HF Trainer |", "|---|---|---|---|"]
    for task in args.tasks:
        scores = {"ours": [], "theirs": []}
        for seed in args.seeds:
            scores["ours"].append(ours(args, glue, task, seed, out))
            scores["theirs"].append(theirs(args, export, glue, task, seed, out))
            lines.append(f"| {task} | {seed} | {scores['ours'][-1]:.1f} | {scores['theirs'][-1]:.1f} |")
            print(lines[-1], flush=True)
        mean = {k: statistics.mean(v) for k, v in scores.items()}
        spread = {k: statistics.stdev(v) if len(v) > 1 else 0.0 for k, v in scores.items()}
        lines.append(f"| {task} | mean ± sd | {mean['ours']:.1f} ± {spread['ours']:.1f} | "
                     f"{mean['theirs']:.1f} ± {spread['theirs']:.1f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

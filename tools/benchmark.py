"""Training throughput of the apps side by side, on one backbone and one device:
    python -m tools.benchmark apps=bert,crossbert,electra preset=debug|cpu|paper [key=value ...] [out=RESULTS.json]

Each app is built on the shared backbone (`encoder.*` overrides apply to all; `app+key=value` in the list changes
one app's model, e.g. `apps=crossbert,crossbert+cms_attention=mask`) and runs full training steps (masking, forward,
backward, gradient clipping, AdamW) on random tokens, as the training loop runs them. After untimed warm-up steps
(compilation happens there), the apps take turns for `rounds` rounds of `steps` timed steps, so a noisy machine's
drift hits every app alike. Printed and written per app: median step time and its spread, data tokens/s,
token-views/s, predicted tokens/s, FLOPs per step as the paper counts them (eq. 7-8, no output head) and with the
output heads, achieved FLOP/s, MFU (with the head, against the device's peak; unknown on a CPU), `mfu_hw` (the FLOPs
as run: attention over the keys each view sees) and peak memory (GPU); then each app's measured speed-up over the
reference (BERT if listed, else the first app) in token-views/s, beside the speed-up each FLOPs count predicts.
`hf-modernbert` in the list adds HuggingFace transformers' ModernBERT MLM at the same shape, an outside reference for
BERT's speed (`pip install transformers`).
"""

import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from lingua.app import app_variant, build_model, load_app
from lingua.args import command_line, load_config, to_dict
from lingua.distributed import DistributedArgs, Launch, resolve_device
from lingua.errors import UserError, at_least, require
from lingua.files import untrusted
from lingua.files.safe import atomic_write
from lingua.metrics import LoggingArgs, peak_flops, setup_logging
from lingua.model.flops import encoder_flops_per_token
from lingua.model.masking import masked_positions, num_masked
from lingua.model.transformer import TransformerArgs, ffn_hidden_dim
from lingua.parallel import autocast
from lingua.training.optim import OptimArgs, build_optimizer
from lingua.training.step import training_step
from tools import paper

logger = logging.getLogger(__name__)

PRESETS = {
    "debug": {"encoder": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seqlen": 64}, "seq_len": 64,
              "batch_size": 4, "vocab_size": 260, "warmup": 1, "steps": 2, "rounds": 2},
    "cpu": {"encoder": {"dim": 384, "n_layers": 8, "n_heads": 6, "max_seqlen": 512}, "seq_len": 512,
            "batch_size": 4, "warmup": 2, "steps": 4, "rounds": 4},
    # The single-scale shapes: each app's model section of apps/<app>/configs/single_scale.yaml.
    "paper": {"encoder": {"dim": 768, "n_layers": 28, "n_heads": 12, "max_seqlen": 512}, "seq_len": 512,
              "batch_size": 32, "warmup": 3, "steps": 10, "rounds": 3},
}
DTYPES = ("auto", "fp32", "bf16")


@dataclass
class BenchmarkArgs:
    apps: str = "bert,crossbert,electra"  # comma-separated; `app+key=value+...` sets fields of that app's model
    preset: str = "cpu"  # debug (seconds) | cpu (dim 384, 8 layers, seq 512) | paper (single-scale shapes)
    encoder: TransformerArgs = field(default_factory=TransformerArgs)  # the backbone all apps share
    seq_len: int = 512  # tokens per sequence
    batch_size: int = 4  # data sequences per step, the same for every app
    vocab_size: int = 50261  # GPT-2's 50257 tokens and the four special ones
    warmup: int = 2  # untimed steps per app
    steps: int = 4  # timed steps per app and round
    rounds: int = 4  # rounds of turns over the apps
    dtype: str = "auto"  # auto: as training (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16 (autocast)
    compile: bool = False  # torch.compile each block, as distributed.compile in training
    compile_backend: str = "inductor"  # as distributed.compile_backend
    device: str = "auto"  # auto: the GPU if there is one, else the CPU
    peak_tflops: float | None = None  # per device, for MFU; default: the GPU's known dense bf16 peak
    seed: int = 0  # model init and random tokens
    out: str = ""  # also write the results here as JSON

    def __post_init__(self):
        require(self.preset in PRESETS, "preset", f"must be one of {', '.join(PRESETS)}, got '{self.preset}'")
        require(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got '{self.dtype}'")
        require(bool(self.apps.strip()), "apps", "is empty: name at least one app, e.g. apps=bert,crossbert")
        at_least(self, 0, "warmup", "seed")
        at_least(self, 1, "seq_len", "batch_size", "steps", "rounds")
        at_least(self, 5, "vocab_size")  # four special tokens and at least one real one
        require(self.seq_len <= self.encoder.max_seqlen, "seq_len",
                f"{self.seq_len} exceeds encoder.max_seqlen {self.encoder.max_seqlen}")


def parse_args(argv: list[str]) -> BenchmarkArgs:
    """The preset's values first, then the command line's (which win)."""
    presets = [arg.partition("=")[2] for arg in argv if arg.startswith("preset=")]
    preset = presets[-1] if presets else BenchmarkArgs.preset
    if preset not in PRESETS:
        raise UserError(f"config key 'preset' must be one of {', '.join(PRESETS)}, got '{preset}'")
    return load_config(BenchmarkArgs, argv, base=PRESETS[preset])


@dataclass
class Contender:
    """One app variant being measured: its model, optimizer, random state and step times."""

    label: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    memory_gib: float | None
    times: list[float] = field(default_factory=list)


class HFModernBert(torch.nn.Module):
    """HuggingFace transformers' ModernBERT MLM at the benchmark's shape: every layer global attention, the SwiGLU
    width as its GeGLU width, BERT's masking (20%), logits of the masked positions only (`sparse_prediction`)."""

    views_per_sequence = 1
    mask_ratio = 0.2

    def __init__(self, args: BenchmarkArgs):
        super().__init__()
        try:
            from transformers import ModernBertConfig, ModernBertForMaskedLM
        except ImportError:
            raise UserError("hf-modernbert needs HuggingFace transformers: pip install transformers") from None
        enc, vocab = args.encoder, args.vocab_size
        require(enc.head_dim in (None, enc.dim // enc.n_heads), "encoder.head_dim", "must be dim // n_heads for "
                "hf-modernbert")
        self.encoder_args, self.mask_id = enc, vocab - 1
        self.model = ModernBertForMaskedLM(ModernBertConfig(
            vocab_size=vocab, hidden_size=enc.dim, intermediate_size=ffn_hidden_dim(enc.dim, enc.ffn_multiple_of),
            num_hidden_layers=enc.n_layers, num_attention_heads=enc.n_heads, max_position_embeddings=enc.max_seqlen,
            layer_types=["full_attention"] * enc.n_layers, sparse_prediction=True, attn_implementation="sdpa",
            bos_token_id=vocab - 4, cls_token_id=vocab - 4, eos_token_id=vocab - 3, sep_token_id=vocab - 3,
            pad_token_id=vocab - 2))

    def make_batch(self, tokens, generator):
        mask_idx = masked_positions(tokens, self.mask_ratio, generator)
        labels = torch.full_like(tokens, -100).scatter(1, mask_idx, tokens.gather(1, mask_idx))
        return {"input_ids": tokens.scatter(1, mask_idx, self.mask_id), "labels": labels}

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss, {}

    def predicted_tokens(self, batch) -> int:
        return batch["labels"].shape[0] * num_masked(self.mask_ratio, batch["labels"].shape[1])

    def flops_per_token_view(self, seq_len: int) -> float:
        return encoder_flops_per_token(self.encoder_args, seq_len)  # the same matrices as BERT's

    def head_flops_per_token_view(self, seq_len: int) -> float:
        dim = self.encoder_args.dim  # its head: a dim x dim dense layer, then the tied decoder
        return 6 * (dim * dim + dim * self.model.config.vocab_size) * self.mask_ratio

    def hardware_flops_per_token_view(self, seq_len: int) -> float:
        """Every token attends over the whole row, as eq. 7 counts: the paper's count with its head."""
        return self.flops_per_token_view(seq_len) + self.head_flops_per_token_view(seq_len)


def build_contender_model(label: str, args: BenchmarkArgs, device: torch.device) -> torch.nn.Module:
    """The app's model: its single-scale config's model section (preset paper) or its defaults, the shared backbone,
    then the label's own overrides."""
    name = label.split("+")[0].strip()
    if name == "hf-modernbert":
        require(name == label, "apps", "hf-modernbert takes no model overrides")
        torch.manual_seed(args.seed)
        model = HFModernBert(args).to(device)
        for layer in model.model.model.layers if args.compile else []:
            layer.compile()  # as the apps' blocks
        return model
    paper_config = load_app(name).config("single_scale")
    base = untrusted.read_yaml(paper_config, "config file")["model"] if args.preset == "paper" and paper_config else {}
    app, model_args = app_variant(label, base | {"encoder": to_dict(args.encoder)})
    tokenizer = SimpleNamespace(vocab_size=args.vocab_size, mask_id=args.vocab_size - 1)
    parallel = (DistributedArgs(compile=args.compile, compile_backend=args.compile_backend), Launch())
    return build_model(app.build_model, model_args, tokenizer, device, args.seed, parallel, plan=app.parallelize)


def build(label: str, args: BenchmarkArgs, device: torch.device) -> Contender:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    model = build_contender_model(label, args, device)
    contender = Contender(label, model, build_optimizer(model, OptimArgs()),
                          torch.Generator(device).manual_seed(args.seed), None)
    for _ in range(args.warmup):
        step(contender, args, device)
    if device.type == "cuda":
        contender.memory_gib = (torch.cuda.max_memory_allocated(device) - before) / 2**30
    return contender


def precision(dtype: str, device: torch.device):
    if dtype == "auto":
        return autocast(device)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


def step(contender: Contender, args: BenchmarkArgs, device: torch.device, synchronise: bool = True) -> float:
    """One full training step on fresh random tokens; returns its wall-clock seconds (on a GPU, waiting for the
    device before and after unless told not to)."""
    synchronise = synchronise and device.type == "cuda"
    tokens = torch.randint(0, args.vocab_size - 4, (args.batch_size, args.seq_len), device=device,
                           generator=contender.generator)
    if synchronise:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    batch = contender.model.make_batch(tokens, contender.generator)
    training_step(contender.model, contender.optimizer, [batch], OptimArgs().clip,
                  lambda: precision(args.dtype, device))
    if synchronise:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(args: BenchmarkArgs) -> dict:
    device = resolve_device(args.device)
    labels = [label.strip() for label in args.apps.split(",") if label.strip()]
    contenders = []
    for label in labels:
        logger.info(f"{label}: building and {args.warmup} warm-up step(s)")
        contenders.append(build(label, args, device))
    for round_ in range(args.rounds):
        logger.info(f"round {round_ + 1}/{args.rounds}: {args.steps} timed step(s) per app")
        for contender in contenders:
            contender.times += [step(contender, args, device) for _ in range(args.steps)]
    peak = peak_flops(LoggingArgs(peak_tflops=args.peak_tflops), device)
    results = {c.label: report(c, args, peak) for c in contenders}
    reference = "bert" if "bert" in results else labels[0]
    for result in results.values():
        result["vs_reference"] = speedups(result, results[reference])
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"cpu ({torch.get_num_threads()} threads)")
    return {"device": device_name, "peak_tflops": peak / 1e12 if peak else None, "reference": reference,
            "torch": torch.__version__, "args": to_dict(args), "results": results}


def report(contender: Contender, args: BenchmarkArgs, peak: float | None) -> dict:
    model, times = contender.model, contender.times
    median = statistics.median(times)
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [median] * 3
    data_tokens = args.batch_size * args.seq_len
    token_views = data_tokens * model.views_per_sequence
    batch = model.make_batch(torch.zeros(args.batch_size, args.seq_len, dtype=torch.long,
                                         device=contender.generator.device), contender.generator)
    flops_paper = model.flops_per_token_view(args.seq_len) * token_views
    flops_with_head = flops_paper + model.head_flops_per_token_view(args.seq_len) * token_views
    flops_hw = model.hardware_flops_per_token_view(args.seq_len) * token_views  # as the kernels run them
    return {
        "step_ms": 1e3 * median,
        "step_ms_iqr": [1e3 * quartiles[0], 1e3 * quartiles[2]],
        "steps_timed": len(times),
        "data_tokens_per_s": data_tokens / median,
        "token_views_per_s": token_views / median,
        "predicted_tokens_per_s": model.predicted_tokens(batch) / median,
        "flops_per_step_paper": flops_paper,
        "flops_per_step_with_head": flops_with_head,
        "achieved_tflops": flops_with_head / median / 1e12,
        "mfu": flops_with_head / median / peak if peak else None,
        "flops_per_step_hw": flops_hw,
        "mfu_hw": flops_hw / median / peak if peak else None,
        "peak_memory_gib": contender.memory_gib,
        "flops_per_token_view_paper": flops_paper / token_views,
        "flops_per_token_view_with_head": flops_with_head / token_views,
    }


def speedups(result: dict, reference: dict) -> dict:
    """Measured token-view rate over the reference's, and what each FLOPs count predicts for it."""
    measured = result["token_views_per_s"] / reference["token_views_per_s"]
    predicted = {count: reference[f"flops_per_token_view_{count}"] / result[f"flops_per_token_view_{count}"]
                 for count in ("paper", "with_head")}
    return {"measured": measured, "predicted_paper": predicted["paper"],
            "predicted_with_head": predicted["with_head"],
            "of_predicted_with_head": measured / predicted["with_head"]}


COLUMNS = [  # header, function of (label, result), width
    ("app", lambda label, r: label, 0),
    ("step ms", lambda label, r: f"{r['step_ms']:,.0f}", 9),
    ("IQR ms", lambda label, r: "{:,.0f}-{:,.0f}".format(*r["step_ms_iqr"]), 13),
    ("data tok/s", lambda label, r: f"{r['data_tokens_per_s']:,.0f}", 11),
    ("views/s", lambda label, r: f"{r['token_views_per_s']:,.0f}", 11),
    ("pred tok/s", lambda label, r: f"{r['predicted_tokens_per_s']:,.0f}", 11),
    ("GFLOP/step paper", lambda label, r: f"{r['flops_per_step_paper'] / 1e9:,.1f}", 17),
    ("+head", lambda label, r: f"{r['flops_per_step_with_head'] / 1e9:,.1f}", 9),
    ("TFLOP/s", lambda label, r: f"{r['achieved_tflops']:.3f}", 8),
    ("MFU", lambda label, r: "unknown" if r["mfu"] is None else f"{r['mfu']:.1%}", 8),
    ("MFU hw", lambda label, r: "unknown" if r["mfu_hw"] is None else f"{r['mfu_hw']:.1%}", 8),
    ("mem GiB", lambda label, r: "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}", 8),
    ("speed-up", lambda label, r: f"{r['vs_reference']['measured']:.2f}x", 9),
    ("pred paper", lambda label, r: f"{r['vs_reference']['predicted_paper']:.2f}x", 11),
    ("pred +head", lambda label, r: f"{r['vs_reference']['predicted_with_head']:.2f}x", 11),
    ("of pred", lambda label, r: f"{r['vs_reference']['of_predicted_with_head']:.0%}", 8),
]


def format_table(report_: dict) -> str:
    rows = [[fn(label, r) for _, fn, _ in COLUMNS] for label, r in report_["results"].items()]
    first = max(len("app"), *(len(row[0]) for row in rows))
    widths = [first] + [max(w, len(h)) for h, _, w in COLUMNS[1:]]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, ((h, _, _), w) in enumerate(zip(COLUMNS, widths)))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    a = report_["args"]
    lines.append(f"{report_['device']}, torch {report_['torch']}: dim {a['encoder']['dim']}, {a['encoder']['n_layers']}"
                 f" layers, seq {a['seq_len']}, batch {a['batch_size']} sequences, dtype {a['dtype']}, compile "
                 f"{a['compile']}, attention {a['encoder']['attn_backend']}; speed-ups in token-views/s against "
                 f"{report_['reference']}, beside the speed-up the paper's FLOPs (eq. 7-8) and the FLOPs with the "
                 "output heads predict; MFU counts the heads")
    if report_["reference"] == "bert" and "crossbert" in report_["results"]:
        published = paper.PROSE["speedup"]
        lines.append(f"the paper (section 5.2): CrossBERT {published['ratio']}x BERT ({published['crossbert']} vs "
                     f"{published['bert']} tokens/s on H100s, at the single-scale shapes)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    with command_line(__doc__):
        args = parse_args(sys.argv[1:] if argv is None else argv)
        setup_logging()
        results = measure(args)
        print(format_table(results))
        if args.out:
            try:
                atomic_write(args.out, json.dumps(results, indent=1))
            except OSError as e:
                raise UserError(f"cannot write {args.out}: {e.strerror}") from None
            print(f"results: {args.out}")


if __name__ == "__main__":
    main()

"""What a CrossBERT checkpoint's predictor reads, on its own validation data (docs/crossbert_slow_start.md):
    python -m apps.crossbert.inspect ckpt=dump/crossbert_debug [n_sequences=64] [seed=0] [app=NAME]

The validation rows of the run's data are masked as in training and one view of each is inspected (view A: the
visible tokens in the encoder, the masked ones as queries). Printed:
- the masked-token accuracy and the most frequent predictions (one token everywhere: the unigram plateau);
- the mean cosine between the positions of a view, for the embeddings as they enter the encoder, the encoder's
  output and the predictor's output: near 1 means one vector shared by all positions, which carries no token;
- for every head of every predictor block, the entropy of its attention (as a fraction of the uniform one) and its
  mean weight at the relative offsets -3..+3 (key position minus query position) and beyond 8. A head that reads
  the neighbours puts its weight at -1 and +1; uniform weights are 1 / (visible tokens);
- for every residual branch of the predictor (each block's attention and feed-forward), the RMS of its output and
  of the part of it that varies between positions (its output minus its mean over all inspected positions): a
  branch that is nearly all its mean adds the same vector everywhere, which after the final norm drowns what the
  varying part carries.
"""

import contextlib
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lingua.app import load_model
from lingua.args import command_line, load_config
from lingua.data.loader import load_validation
from lingua.errors import UserError, at_least

OFFSETS = (-3, -2, -1, 1, 2, 3)
FAR = 8


@dataclass
class InspectArgs:
    ckpt: str = ""  # a CrossBERT run's dump_dir, a checkpoint folder or a consolidated.pt
    n_sequences: int = 64  # validation rows to inspect
    seed: int = 0  # the masking of those rows
    app: str = ""  # ckpt's app when not one of this code's (e.g. my_pkg.my_app): trusted to rebuild it

    def __post_init__(self):
        at_least(self, 1, "n_sequences")


def attention_weights(attention, x, context, q_rope, kv_rope) -> torch.Tensor:
    """The softmax weights [B, H, Q, K] that `attention` (lingua.model.transformer.Attention, unmasked) gives."""
    q, k = attention.rotated_queries_keys(x, context, q_rope, kv_rope)
    return (torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(attention.head_dim)).softmax(-1)


def rms(h: torch.Tensor) -> float:
    """Root mean square of all the entries of h."""
    return h.float().pow(2).mean().sqrt().item()


def branch_sizes(output: torch.Tensor) -> dict[str, float]:
    """RMS of a branch's output [B, Q, D] and of its deviation from its mean vector over all B x Q positions (the
    squares add up: rms^2 = varying^2 + mean^2)."""
    return {"rms": rms(output), "varying": rms(output - output.float().mean((0, 1)))}


@contextlib.contextmanager
def recording(predictor):
    """Per block of the predictor, while it runs unmasked: the softmax weights [B, H, Q, K] of its attention and what
    its attention and feed-forward branches add to the residual stream."""
    blocks = [{} for _ in predictor.layers]

    def record(block: dict, name: str):
        def hook(module, inputs, output):
            if name == "attention":  # inputs: Attention.forward(x, context, q_rope, kv_rope, bias=None, backend)
                block["weights"] = attention_weights(module, *inputs[:4])
            block[name] = output
        return hook

    hooks = [module.register_forward_hook(record(block, name))
             for block, layer in zip(blocks, predictor.layers)
             for name, module in (("attention", layer.attention), ("feed-forward", layer.feed_forward))]
    try:
        yield blocks
    finally:
        for hook in hooks:
            hook.remove()


def mean_cosine(h: torch.Tensor) -> float:
    """The mean cosine similarity between the positions of each row of h [B, S, D] (self-pairs included)."""
    unit = F.normalize(h.float(), dim=-1)
    return (unit @ unit.transpose(1, 2)).mean().item()


@torch.no_grad()
def inspect(model, tokens: torch.Tensor, seed: int) -> dict:
    """Collapse measures and per-head attention profiles of view A of each row of tokens [B, S]."""
    batch = model.make_batch(tokens, torch.Generator().manual_seed(seed))
    view = model.args.layout(tokens.shape[1]).views[0]
    encoder_mask, _ = model.view_masks(*batch["inputs"].shape) if model.args.cms else (None, None)
    context = model.encoder(batch["inputs"], batch["positions"], encoder_mask)[:, :view.visible]
    keys, queries = batch["positions"][:, :view.visible], batch["query_positions"][:, :view.masked]
    predictor = model.predictor
    with recording(predictor) as blocks:
        outputs = predictor(context, keys, queries, None)
    offsets = keys[:, None, :] - queries[:, :, None]  # [B, Q, K]
    heads, branches = [], []
    for index, block in enumerate(blocks):
        weights = block["weights"]
        entropy = -(weights * weights.clamp_min(1e-12).log()).sum(-1).mean((0, 2)) / math.log(weights.shape[-1])
        for head in range(weights.shape[1]):
            w = weights[:, head]
            heads.append({"entropy": entropy[head].item(),
                          "at": {d: w[offsets == d].mean().item() for d in OFFSETS},
                          "far": w[offsets.abs() > FAR].mean().item()})
        branches += [{"name": f"{index}.{name}", **branch_sizes(block[name])} for name in ("attention", "feed-forward")]
    predictions = model.encoder.logits(outputs).argmax(-1)
    targets = batch["targets"][:, :view.masked]
    return {
        "accuracy": (predictions == targets).float().mean().item(),
        "top_predictions": torch.bincount(predictions.flatten(), minlength=3).topk(3),
        "predictions": predictions.numel(),
        "cosine": {"embeddings": mean_cosine(model.encoder.embed(batch["inputs"][:, :view.visible])),
                   "encoder": mean_cosine(context), "predictor": mean_cosine(outputs)},
        "heads": heads,
        "branches": branches,
        "mask_embedding": rms(predictor.mask_embedding),
        "uniform": 1 / view.visible,
    }


def report(found: dict, tokenizer, n_heads: int) -> str:
    counts, ids = found["top_predictions"]
    total = found["predictions"]
    top = ", ".join(f"{tokenizer.decode([i])!r} {n / total:.0%}" for n, i in zip(counts.tolist(), ids.tolist()))
    cos = found["cosine"]
    lines = [f"masked-token accuracy {found['accuracy']:.3f}; most frequent predictions: {top}",
             f"mean cosine between positions: embeddings {cos['embeddings']:.3f}, encoder output "
             f"{cos['encoder']:.3f}, predictor output {cos['predictor']:.3f}",
             f"predictor attention (uniform weight {found['uniform']:.4f}): block.head, entropy / uniform, "
             f"mean weight at offsets {' '.join(f'{d:+d}' for d in OFFSETS)}, beyond {FAR}"]
    for index, head in enumerate(found["heads"]):
        weights = " ".join(f"{head['at'][d]:.3f}" for d in OFFSETS)
        lines.append(f"  {index // n_heads}.{index % n_heads}  {head['entropy']:.3f}  {weights}  {head['far']:.3f}")
    lines.append(f"predictor branches: block.branch, RMS of the output, of its part that varies between positions "
                 f"(mask embedding RMS {found['mask_embedding']:.3f})")
    lines += [f"  {b['name']}  {b['rms']:.3f}  {b['varying']:.3f}" for b in found["branches"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    with command_line(__doc__):
        args = load_config(InspectArgs, sys.argv[1:] if argv is None else argv)
        if not args.ckpt:
            raise UserError("ckpt= is required: a CrossBERT run's dump_dir, a checkpoint folder or a consolidated.pt")
        model, config, tokenizer = load_model(args.ckpt, app=args.app or None)
        if not hasattr(model, "predictor"):
            raise UserError(f"{args.ckpt} is not a CrossBERT checkpoint (its model has no predictor)")
        tokens = load_validation(config.data, tokenizer, args.n_sequences).tokens
        print(report(inspect(model, tokens, args.seed), tokenizer, model.predictor.args.n_heads))


if __name__ == "__main__":
    main()

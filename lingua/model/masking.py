"""Static-shape masking and the masked-LM loss, shared by the apps.

A row of S tokens gets exactly round(ratio * S) masked positions, picked by a random permutation (argsort of uniform
noise drawn from the loop's generator), so no tensor shape depends on the draw and torch.compile sees static shapes.
"""

import importlib.util

import torch
import torch.nn.functional as F

from lingua.errors import UserError, require


def check_mask_ratio(mask_ratio: float) -> None:
    """The check of an app's `mask_ratio` config field, from its `__post_init__`. Whether a ratio masks at least one
    token of a row, and not every token, depends on the row's length too: `num_masked` says so when it is known."""
    require(0 < mask_ratio < 1, "mask_ratio", f"must be strictly between 0 and 1, got {mask_ratio}")


def num_masked(mask_ratio: float, seq_len: int) -> int:
    """round(mask_ratio * seq_len); a ratio that masks no token, or every token, of a row is a UserError."""
    n = round(mask_ratio * seq_len)
    if not 0 < n < seq_len:
        raise UserError(f"mask_ratio {mask_ratio} masks {n} of {seq_len} tokens per sequence; need 0 < masked < "
                        f"{seq_len}: change model.mask_ratio or data.seq_len")
    return n


def random_positions(batch: int, seq_len: int, generator: torch.Generator, device) -> torch.Tensor:
    """One random permutation of 0..seq_len-1 per row, [batch, seq_len]."""
    noise = torch.rand(batch, seq_len, generator=generator, device=device)
    return noise.argsort(dim=1)


def masked_positions(tokens: torch.Tensor, mask_ratio: float, generator: torch.Generator) -> torch.Tensor:
    """The round(mask_ratio * S) positions masked in each row of tokens [B, S], a random permutation's first ones
    (unsorted): [B, M]."""
    n_masked = num_masked(mask_ratio, tokens.shape[1])
    return random_positions(*tokens.shape, generator, tokens.device)[:, :n_masked]


def gather_tokens(h: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """h [B, S, D], index [B, K] -> [B, K, D]."""
    return h.gather(1, index.unsqueeze(-1).expand(-1, -1, h.shape[-1]))


def masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    precision = torch.promote_types(logits.dtype, torch.float32)  # bf16 logits are summed in fp32
    loss = F.cross_entropy(logits.flatten(0, 1).to(precision), targets.flatten())
    accuracy = (logits.argmax(-1) == targets).float().mean()
    return loss, {"accuracy": accuracy.detach()}


HEAD_LOSSES = ("auto", "eager", "compiled", "liger")


def head_loss_path(head_loss: str, device: torch.device) -> str:
    """The path `head_loss` takes on this device. auto: the compiled chunks on a GPU, eager on a CPU (where
    Inductor's compile of the chunk costs more than a short run saves: docs/performance.md). Liger's kernel is taken
    only when asked for (untested here)."""
    if head_loss == "liger" and not (device.type == "cuda" and importlib.util.find_spec("liger_kernel")):
        raise UserError("encoder.head_loss=liger needs a CUDA device and liger_kernel installed")
    if head_loss != "auto":
        return head_loss
    return "compiled" if device.type == "cuda" else "eager"


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                    bias: torch.Tensor | None = None, head_loss: str = "eager",
                    compile_backend: str = "inductor") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`masked_lm_loss(F.linear(hidden, weight, bias), targets)` without the [tokens, vocab] logits ever existing
    whole: the logits of chunk_tokens rows at a time, whose gradients are computed at once and kept (2 d V FLOPs
    forward and 4 backward, as unchunked). Exact up to float summation order; a prediction counts as correct when the
    target's logit is the largest (a tie, which argmax would break by index, counts too). head_loss (`HEAD_LOSSES`,
    resolved by `head_loss_path`): eager is the reference; compiled runs each chunk as one torch.compile'd function
    (static shapes: the last, shorter chunk is compiled once more); liger is Liger's kernel, untested here."""
    path = head_loss_path(head_loss, hidden.device)
    if path == "liger":
        return _liger_lm_loss(hidden.flatten(0, -2), weight, targets.flatten(), bias)
    chunk_fn = _compiled_chunk(compile_backend) if path == "compiled" else _chunk_loss_and_grads
    with_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    loss, accuracy = _ChunkedLinearCrossEntropy.apply(hidden.flatten(0, -2), weight, bias, targets.flatten(),
                                                      chunk_tokens, with_grad, chunk_fn)
    return loss, {"accuracy": accuracy}


def _liger_lm_loss(hidden, weight, targets, bias):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(hidden, weight, targets, bias, return_token_accuracy=True)
    return out.loss, {"accuracy": out.token_accuracy.detach()}


def _chunk_loss_and_grads(h, targets, weight, bias, grad_weight, grad_bias):
    """One chunk's summed loss and correct count; with grad_weight, the gradients of its summed loss, d/d(logits) =
    softmax - one_hot, added into grad_weight and grad_bias (fp32) and returned for h. The logits stay in h's dtype
    (bf16 on a GPU) until the fp32 log-sum-exp; the gradient of the logits is written once, in h's dtype."""
    precision = torch.promote_types(h.dtype, torch.float32)
    logits = F.linear(h, weight, bias).to(precision)
    log_sum_exp = logits.logsumexp(-1, keepdim=True)
    target_logits = logits.gather(1, targets[:, None])
    loss_sum = (log_sum_exp - target_logits).sum()
    correct = (target_logits.squeeze(1) >= logits.amax(-1)).sum()
    if grad_weight is None:
        return loss_sum, correct, None
    minus_one = logits.new_full(target_logits.shape, -1.0)  # in place: one [chunk, vocab] buffer in eager mode
    grad_logits = logits.sub_(log_sum_exp).exp_().scatter_add_(1, targets[:, None], minus_one)
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0)
    grad_logits = grad_logits.to(h.dtype)
    grad_weight += (grad_logits.t() @ h).to(precision)
    return loss_sum, correct, grad_logits @ weight.to(h.dtype)


_COMPILED_CHUNKS = {}  # by backend; a dict, not functools.cache, which Dynamo warns of when a compiled step calls it


def _compiled_chunk(backend: str):
    if backend not in _COMPILED_CHUNKS:
        _COMPILED_CHUNKS[backend] = torch.compile(_chunk_loss_and_grads, backend=backend, dynamic=False)
    return _COMPILED_CHUNKS[backend]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens, with_grad, chunk_fn):
        n = hidden.shape[0]
        precision = torch.promote_types(hidden.dtype, torch.float32)  # bf16 logits are summed in fp32
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        grad_weight = torch.zeros_like(weight, dtype=precision) if with_grad else None
        grad_bias = torch.zeros_like(bias, dtype=precision) if with_grad and bias is not None else None
        loss_sum = hidden.new_zeros((), dtype=precision)
        correct = hidden.new_zeros((), dtype=precision)
        for start in range(0, n, chunk_tokens):
            end = start + chunk_tokens
            chunk_loss, chunk_correct, chunk_grad_hidden = chunk_fn(hidden[start:end], targets[start:end], weight,
                                                                    bias, grad_weight, grad_bias)
            loss_sum, correct = loss_sum + chunk_loss, correct + chunk_correct
            if with_grad:  # the 1/n is applied once, in backward
                grad_hidden[start:end] = chunk_grad_hidden
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.n, ctx.weight_dtype = n, weight.dtype
        accuracy = correct / n
        ctx.mark_non_differentiable(accuracy)
        return loss_sum / n, accuracy

    @staticmethod
    def backward(ctx, grad_loss, grad_accuracy):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_loss / ctx.n
        grad_bias = None if grad_bias is None else (grad_bias * scale).to(ctx.weight_dtype)
        grad_weight = (grad_weight * scale).to(ctx.weight_dtype)
        return grad_hidden * scale.to(grad_hidden.dtype), grad_weight, grad_bias, None, None, None, None

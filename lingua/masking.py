"""Static-shape masking and the masked-LM loss, shared by the apps.

A row of S tokens gets exactly round(ratio * S) masked positions, picked by a random permutation (argsort of uniform
noise drawn from the loop's generator), so no tensor shape depends on the draw and torch.compile sees static shapes.
"""

import torch
import torch.nn.functional as F

from lingua.args import UserError


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


def gather_tokens(h: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """h [B, S, D], index [B, K] -> [B, K, D]."""
    return h.gather(1, index.unsqueeze(-1).expand(-1, -1, h.shape[-1]))


def masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    precision = torch.promote_types(logits.dtype, torch.float32)  # bf16 logits are summed in fp32
    loss = F.cross_entropy(logits.flatten(0, 1).to(precision), targets.flatten())
    accuracy = (logits.argmax(-1) == targets).float().mean()
    return loss, {"accuracy": accuracy.detach()}


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    chunk_tokens: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`masked_lm_loss(hidden @ weight.T, targets)` without the [tokens, vocab] logits ever existing whole: the
    logits of chunk_tokens rows at a time, whose gradients are computed at once and kept (2 d V FLOPs forward and 4
    backward, as unchunked). Exact up to float summation order."""
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, accuracy = _ChunkedLinearCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(), chunk_tokens,
                                                      with_grad)
    return loss, {"accuracy": accuracy}


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, with_grad):
        n = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        precision = torch.promote_types(hidden.dtype, torch.float32)  # bf16 logits are summed in fp32
        grad_weight = torch.zeros_like(weight, dtype=precision) if with_grad else None
        loss_sum = hidden.new_zeros((), dtype=precision)
        correct = hidden.new_zeros((), dtype=precision)
        for start in range(0, n, chunk_tokens):
            h, t = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
            logits = (h @ weight.t()).to(precision)
            log_z = logits.logsumexp(-1)
            loss_sum = loss_sum + (log_z - logits.gather(1, t[:, None]).squeeze(1)).sum()
            correct = correct + (logits.argmax(-1) == t).sum()
            if with_grad:  # d(mean loss)/d(logits) = (softmax - one_hot) / n
                grad_logits = (logits - log_z[:, None]).exp_()
                grad_logits.scatter_add_(1, t[:, None], grad_logits.new_full((len(t), 1), -1.0)).div_(n)
                grad_logits = grad_logits.to(h.dtype)
                grad_hidden[start:start + chunk_tokens] = grad_logits @ weight.to(h.dtype)
                grad_weight += (grad_logits.t() @ h).to(precision)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        accuracy = correct / n
        ctx.mark_non_differentiable(accuracy)
        return loss_sum / n, accuracy

    @staticmethod
    def backward(ctx, grad_loss, grad_accuracy):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, (grad_weight * grad_loss).to(ctx.weight_dtype), None, None, None

"""LM head + cross-entropy, chunked so the full [tokens, vocab] logits are never held.

With a 262k vocabulary the fp32 logits of 32k tokens are 34 GB; a chunk of 1024 tokens is 1 GiB.
The chunked loss computes each chunk's gradient in the forward pass (a fused linear
cross-entropy), so backward needs neither the logits nor a recompute of the head matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum over rows of CE(softcap(hidden @ weight.T), targets), chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, softcap):  # type: ignore[override]
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[start : start + chunk_tokens]
            y = targets[start : start + chunk_tokens]
            logits = (h @ weight.t()).float()
            capped = None
            if softcap:
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
            lse = torch.logsumexp(logits, dim=-1)
            loss += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
            if need_hidden or need_weight:
                # d loss / d logits = softmax - onehot, built in place over the logits buffer
                grad = logits.sub_(lse[:, None]).exp_()
                grad[torch.arange(len(y), device=grad.device), y] -= 1.0
                if capped is not None:
                    grad.mul_(1.0 - capped * capped)
                grad = grad.to(weight.dtype)
                if need_hidden:
                    grad_hidden[start : start + chunk_tokens] = grad @ weight
                if need_weight:
                    grad_weight += (grad.t() @ h).float()
        ctx.save_for_backward(
            grad_hidden if grad_hidden is not None else torch.empty(0),
            grad_weight if grad_weight is not None else torch.empty(0),
        )
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        out_hidden = (
            grad_hidden * grad_output.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        )
        out_weight = (
            (grad_weight * grad_output).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        )
        return out_hidden, out_weight, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    chunk_tokens: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """Summed CE of `head(hidden)` against `targets` ([N, d], [N]), never holding [N, vocab].

    A plain bias-free nn.Linear head uses the fused path; any other head (a bias, an adapter on
    the head) is chunked with activation checkpointing, which recomputes each chunk's logits.
    """
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0
    if type(head) is nn.Linear and head.bias is None:
        return _ChunkedLinearCrossEntropy.apply(hidden, head.weight, targets, chunk_tokens, softcap)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        total = total + torch.utils.checkpoint.checkpoint(
            _chunk_loss,
            hidden[start : start + chunk_tokens],
            head,
            targets[start : start + chunk_tokens],
            softcap,
            use_reentrant=False,
        )
    return total


def _chunk_loss(h: torch.Tensor, head: nn.Module, y: torch.Tensor, softcap: float | None):
    logits = head(h).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, y, reduction="sum")


def full_logits_cross_entropy(
    hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, softcap: float | None = None
) -> torch.Tensor:
    """The unchunked baseline, as a stock causal-LM forward does it: logits for every position
    ([B, T, vocab], upcast to fp32), shift by one, mean CE over labels != -100."""
    logits = head(hidden).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    shift_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX)


def shifted_loss_positions(
    hidden: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states that predict a loss token, and those tokens: position t predicts t+1."""
    shift_hidden = hidden[:, :-1]
    shift_labels = labels[:, 1:]
    keep = shift_labels != IGNORE_INDEX
    return shift_hidden[keep], shift_labels[keep]


def loss_positions_cross_entropy(
    hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, softcap: float | None = None
) -> torch.Tensor:
    """The stock loss on the loss positions only: their logits at once ([n_loss, vocab], fp32),
    mean CE. Differs from full_logits_cross_entropy only in which positions reach the head, and
    from the chunked loss only in the chunking."""
    rows, targets = shifted_loss_positions(hidden, labels)
    if rows.shape[0] == 0:
        return hidden.sum() * 0.0
    logits = head(rows).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, targets)

"""How far a cache's next-token distributions are from the dense cache's: KL and top-1 agreement."""

from __future__ import annotations

import torch


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref ‖ p) per position in nats; both (N, V) -> (N,) float64."""
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    test = torch.log_softmax(logits.double(), dim=-1)
    return (ref.exp() * (ref - test)).sum(dim=-1)


def top1_matches(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """(N,) bool: the most likely next token is the same."""
    return reference_logits.argmax(dim=-1) == logits.argmax(dim=-1)

"""RMSNorm on eagle's CPU kernels (``eagle::rms_norm``): each row normalised by one fixed sequence of roundings (the
decoder layers' norm, :func:`eagle.kernels.reference.lane_rms_norm` bit for bit), in one native call instead of
the eight tensor operations of the float32 formula. The quantized draft head (``draft_dtype="q8_0"``) uses it."""

from __future__ import annotations

import torch
from torch import nn

from eagle import kernels


class KernelRMSNorm(nn.Module):
    """``weight * (x * (1 / sqrt(mean(x^2) + eps)))`` over the last dimension, float32 on the CPU, with the kernels'
    row order; other inputs (another dtype or device, kernels unavailable) take the float32 formula of the layer it
    replaces (``RMSNorm`` of :mod:`eagle.model.heads.draft_layers`)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.float32).contiguous(), requires_grad=False)
        self.variance_epsilon = eps

    @classmethod
    def from_norm(cls, norm: nn.Module) -> "KernelRMSNorm":
        return cls(norm.weight, norm.variance_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] and kernels.available():
            return kernels.ops().rms_norm(x, self.weight, self.variance_epsilon)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(x.dtype)

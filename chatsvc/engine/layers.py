"""The RoPE tables of the Llama forward pass.

The linear layers are in ``kernels.linear``; the element-wise layers (RMSNorm,
RoPE, SwiGLU) are kernels, bound per step (``kernels.step``)."""

from __future__ import annotations

import math

import torch

from chatsvc.engine.model_config import ModelConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32), with linear or Llama-3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq.float()
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).float()
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between low_freq_wavelen and high_freq_wavelen blends the two smoothly.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled).float()


class RotaryTables:
    """cos/sin for every position, computed once; a step only gathers its positions' rows."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if max_positions <= 0:
            raise ValueError(f"max_positions must be positive, got {max_positions}")
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # Both halves of a head share the angle (HF's rotate_half layout), so store it twice.
        angles = torch.cat([angles, angles], dim=-1)  # [P, D]
        self.max_positions = max_positions
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the given positions, each ``[T, 1, D]`` (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

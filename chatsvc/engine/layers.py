"""Building blocks of the Llama forward pass: the RoPE tables and the (prepacked) linears.

The element-wise layers (RMSNorm, RoPE, SwiGLU) are in kernels/."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from chatsvc.engine.model_config import ModelConfig, RopeScaling
from kernels.tile_linear import TileWeight
from kernels.tile_linear import tile_linear as _tile_linear


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


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN weight prepacking is available: a CPU build with mkldnn, fp32 or bf16."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
    )


def prepack(weight: torch.Tensor, batch_hint: int = 8) -> torch.Tensor:
    """A ``[out, in]`` weight in oneDNN's blocked layout, so no matmul reorders it per call.

    The hint only picks the layout; any number of input rows works.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x @ weight^T + bias`` with a plain weight."""
    return F.linear(x, weight, bias)


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + x @ weight^T`` in one call (addmm), a plain weight."""
    return torch.addmm(residual, x, weight.t())


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x @ weight^T + bias`` with a weight from ``prepack``."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def packed_linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor):
    """``residual + x @ weight^T`` in one call, a weight from ``prepack``."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, None, "add")


def tile_linear(x: torch.Tensor, weight: TileWeight, bias: torch.Tensor | None = None):
    """``x @ weight^T + bias`` with a weight from ``kernels.tile_linear.pack_tile_weight``."""
    return _tile_linear(x, weight, bias)


def tile_linear_add(x: torch.Tensor, weight: TileWeight, residual: torch.Tensor):
    """``residual + x @ weight^T`` in one call, a tile-packed weight."""
    return _tile_linear(x, weight, None, residual)

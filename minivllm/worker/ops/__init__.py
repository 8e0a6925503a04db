"""Fused small ops in Triton, each with a torch fallback of the same signature.

The public functions dispatch on the tensor: CUDA (or the Triton interpreter) runs the kernel,
anything else the `*_torch` version. `sampling` holds the device sampler.
"""

from minivllm.worker.ops.activation import silu_and_mul
from minivllm.worker.ops.norm import fused_add_rms_norm, rms_norm
from minivllm.worker.ops.rotary import build_cos_sin_cache, qk_norm_rope

__all__ = ["build_cos_sin_cache", "fused_add_rms_norm", "qk_norm_rope", "rms_norm", "silu_and_mul"]

"""Fused small ops in Triton, each with a torch fallback of the same signature.

The public functions dispatch on the tensor: CUDA (or the Triton interpreter) runs the kernel,
anything else the `*_torch` version. `gemv` holds the batch-1 linear, `sampling` the device
sampler.
"""

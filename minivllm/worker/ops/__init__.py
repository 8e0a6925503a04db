"""Fused small ops in Triton, each with a torch fallback of the same signature for CPU."""

"""Speculative decoding in the worker: verifying draft tokens (verification.py) and the
draft model that proposes them (draft_model.py)."""

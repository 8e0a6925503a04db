"""Structured outputs in the engine-core: grammar compilation, matchers, token bitmasks."""

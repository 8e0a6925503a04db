"""The MINIVLLM_* environment variables: read in envs.py only, each one documented there."""

from __future__ import annotations

import pathlib
import re

import pytest

from minivllm import envs

PACKAGE = pathlib.Path(envs.__file__).parent


def test_a_bad_number_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("MINIVLLM_STARTUP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MINIVLLM_STARTUP_TIMEOUT must be a number"):
        envs.startup_timeout_s()
    monkeypatch.setenv("MINIVLLM_STARTUP_TIMEOUT", "2.5")
    assert envs.startup_timeout_s() == 2.5
    monkeypatch.delenv("MINIVLLM_STARTUP_TIMEOUT")
    assert envs.startup_timeout_s() == 900.0


def test_every_variable_is_read_in_envs_and_in_its_table() -> None:
    documented = set(re.findall(r"^\| (MINIVLLM_\w+)", envs.__doc__ or "", re.M))
    read = set(re.findall(r'"(MINIVLLM_\w+)"', pathlib.Path(envs.__file__).read_text()))
    assert read == documented
    elsewhere = re.compile(r"(environ|getenv)\W+[^\n]*MINIVLLM_")
    for path in PACKAGE.rglob("*.py"):
        if path.name != "envs.py":
            assert not elsewhere.search(path.read_text()), path

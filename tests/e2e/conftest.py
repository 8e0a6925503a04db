from __future__ import annotations

import pytest

from tests.e2e.daemon import Daemon
from tests.tiny_models import build_null_checkpoint


@pytest.fixture(scope="module")
def null_daemon(tmp_path_factory):
    """A daemon serving the null model on an ipc socket, shared by a module's tests."""
    root = tmp_path_factory.mktemp("daemon")
    model = build_null_checkpoint(str(root / "null"))
    d = Daemon(model, f"ipc://{root}/engine", str(root / "daemon.log"))
    d.wait_listening()
    yield d
    d.stop()

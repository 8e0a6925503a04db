"""The frontend's device decision: the same as torch's, without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from minivllm import devices


def test_auto_picks_what_torch_would_without_importing_it() -> None:
    code = (
        "import sys\n"
        "from minivllm.devices import cuda_device_count, resolve_device\n"
        "print(resolve_device('auto'), cuda_device_count(), 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    want = "cuda" if torch.cuda.is_available() else "cpu"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert out.stdout.split() == [want, str(count), "False"], out.stdout + out.stderr


def test_the_installed_torch_build_is_read_from_its_version_file() -> None:
    assert devices._torch_cuda_build() == (torch.version.cuda is not None)


@pytest.mark.parametrize(
    ("text", "build"),
    [
        (
            "__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n",
            False,
        ),
        ("__version__ = '2.11.0+cu128'\ncuda: Optional[str] = '12.8'\nhip = None\n", True),
        ("cuda: Optional[str] = None\nhip: Optional[str] = '6.3.4'\n", None),  # ROCm: ask torch
        ("__version__ = '2.11.0'\n", None),
    ],
)
def test_version_file_texts(text: str, build: bool | None) -> None:
    assert devices.cuda_build_of(text) is build


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_cuda_without_a_gpu_is_an_error_naming_the_device() -> None:
    with pytest.raises(ValueError, match="device='cuda'"):
        devices.resolve_device("cuda")


def test_gpu_sharing_checks_count_the_visible_gpus(monkeypatch) -> None:
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) is larger than the 2"):
        devices.check_gpu_sharing(4, 1, 0.9)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization .* <= 0.500, got 0.9"):
        devices.check_gpu_sharing(1, 4, 0.9)
    devices.check_gpu_sharing(1, 4, 0.45)
    devices.check_gpu_sharing(2, 1, 0.9)

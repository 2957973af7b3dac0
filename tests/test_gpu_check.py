"""No GPU, no driver, an old driver, no device: one splitkv error that says which (CPU only: a
stand-in for CuPy's runtime gives each case on any machine)."""

from __future__ import annotations

import numpy as np
import pytest

import splitkv
from splitkv import cli, gpu


class _Runtime:
    """CuPy's runtime module as a machine in a given state would answer."""

    def __init__(self, driver=13000, runtime=13000, devices=1, count_error=None):
        self.driver, self.runtime, self.devices, self.count_error = driver, runtime, devices, count_error

    def driverGetVersion(self):  # noqa: N802 - CuPy's names
        return self.driver

    def runtimeGetVersion(self):  # noqa: N802
        return self.runtime

    def getDeviceCount(self):  # noqa: N802
        if self.count_error is not None:
            raise self.count_error
        return self.devices


def _machine(monkeypatch, **state):
    monkeypatch.setattr(gpu, "_cuda_runtime", lambda: _Runtime(**state))


def _no_cupy():
    raise ImportError("libcudart.so.13: cannot open shared object file")


@pytest.mark.parametrize("state, expected", [
    (dict(driver=0), "no NVIDIA driver is installed or loadable here"),
    (dict(driver=12080, runtime=13000), "the NVIDIA driver supports CUDA up to 12.8, older than the CUDA 13.0 "
                                        "runtime CuPy was built for; update the driver, or install the extra of "
                                        "the driver's CUDA major version (e.g. splitkv[cu12])"),
    (dict(count_error=RuntimeError("cudaErrorNoDevice")), "the CUDA driver found no usable device (RuntimeError: "
                                                          "cudaErrorNoDevice)"),
    (dict(devices=0), "the CUDA driver sees no device"),
])
def test_each_missing_piece_is_named(monkeypatch, state, expected):
    _machine(monkeypatch, **state)
    assert expected in gpu.unavailable_reason()
    with pytest.raises(splitkv.GpuUnavailableError, match="no usable CUDA GPU: "):
        gpu.require_gpu()


def test_no_cupy_says_which_extra(monkeypatch):
    monkeypatch.setattr(gpu, "_cuda_runtime", _no_cupy)
    assert "CuPy cannot be imported (ImportError: libcudart.so.13" in gpu.unavailable_reason()
    assert "pip install 'splitkv[cu13]'" in gpu.unavailable_reason()


def test_no_device_names_the_visible_devices(monkeypatch):
    _machine(monkeypatch, devices=0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu.unavailable_reason() == "the CUDA driver sees no device (CUDA_VISIBLE_DEVICES='')"


def test_a_device_past_the_count(monkeypatch):
    _machine(monkeypatch, devices=2)
    assert gpu.unavailable_reason() is None
    assert gpu.unavailable_reason(1) is None
    assert gpu.unavailable_reason(2) == "device 2 does not exist: the CUDA driver sees 2 (0..1)"


def test_an_older_driver_of_the_same_major_version_is_usable(monkeypatch):
    _machine(monkeypatch, driver=13000, runtime=13020)  # CUDA's minor version compatibility
    assert gpu.unavailable_reason() is None


def test_a_usable_machine(monkeypatch):
    _machine(monkeypatch, driver=13020, runtime=13000, devices=8)
    assert gpu.unavailable_reason() is None
    gpu.require_gpu(7)


def test_decode_attention_says_there_is_no_gpu(monkeypatch):
    import cupy

    def no_driver(ordinal=None):
        raise cupy.cuda.runtime.CUDARuntimeError(35)  # cudaErrorInsufficientDriver, as CuPy raises it here
    monkeypatch.setattr(cupy.cuda, "Device", no_driver)
    _machine(monkeypatch, driver=0)
    with pytest.raises(splitkv.GpuUnavailableError, match="no NVIDIA driver is installed"):
        splitkv.DecodeAttention(num_qo_heads=8, num_kv_heads=1, head_dim=128)


@pytest.mark.parametrize("device", ["0", 1.0, True])
def test_decode_attention_device_is_an_ordinal(device):
    with pytest.raises(TypeError, match="device: expected a CUDA device ordinal"):
        splitkv.DecodeAttention(num_qo_heads=8, num_kv_heads=1, head_dim=128, device=device)


def test_a_host_array_without_a_gpu_says_both(monkeypatch):
    _machine(monkeypatch, driver=0)
    q = np.zeros((1, 8, 128), np.float16)
    with pytest.raises(TypeError, match=r"q: must be on a CUDA device; got a host array .* \(and there is no "
                                        r"usable CUDA GPU here: no NVIDIA driver"):
        splitkv.decode(q, q, q)


def test_a_host_array_on_a_gpu_machine_says_only_that(monkeypatch):
    _machine(monkeypatch)
    q = np.zeros((1, 8, 128), np.float16)
    with pytest.raises(TypeError) as raised:
        splitkv.decode(q, q, q)
    assert "no usable CUDA GPU" not in str(raised.value)


def test_tuning_without_a_gpu_is_one_line(monkeypatch, capsys, tmp_path):
    _machine(monkeypatch, driver=0)
    rc = cli.main(["--arch", "sm90", "--tune", "--head-dim", "128", "--group", "4", "--dtype", "bf16",
                   "--bucket", "b1-l1k", "--out", str(tmp_path / "tables")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("splitkv-gen: --tune measures on a GPU of sm_90, and none is usable here: no NVIDIA "
                              "driver is installed")
    assert "--cost-model tunes without one" in err[-1]
    assert not (tmp_path / "tables").exists()


def test_tuning_on_a_missing_device_is_one_line(monkeypatch, capsys, tmp_path):
    _machine(monkeypatch, devices=1)
    rc = cli.main(["--arch", "sm90", "--tune", "--head-dim", "128", "--group", "4", "--dtype", "bf16",
                   "--bucket", "b1-l1k", "--devices", "0,3", "--storage", str(tmp_path / "tune.log")])
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "splitkv-gen: --devices 0,3: GPU 3 is not usable here: device 3 does not exist: the CUDA driver sees 1 (0..0)")
    assert not (tmp_path / "tune.log").exists()

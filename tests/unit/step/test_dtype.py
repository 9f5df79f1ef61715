"""profile.dtype: auto is bfloat16 only where the device computes it natively (issue 13)."""

import logging

import pytest
import torch

from conftest import workflow_config
from probes.profile import prepare as pp
from probes.step import dtype as dc

# the machine: a 2-core AMD EPYC with AVX2 and no bf16 units
AVX2_EPYC = dc.CpuBf16Facts("x86_64", "AVX2", avx512_bf16=False, amx_bf16=False, onednn_bf16=False)
# AVX512 without BF16 units: oneDNN reports bf16 support, but converts to float32
AVX512_NO_BF16 = dc.CpuBf16Facts("x86_64", "AVX512", False, False, onednn_bf16=True)
SAPPHIRE_RAPIDS = dc.CpuBf16Facts("x86_64", "AVX512", True, amx_bf16=True, onednn_bf16=True)
COOPER_LAKE = dc.CpuBf16Facts("x86_64", "AVX512", True, False, onednn_bf16=True)
GRAVITON3 = dc.CpuBf16Facts("aarch64", "SVE256", False, False, onednn_bf16=True)
# bf16 units, but a torch build whose oneDNN does not use them
UNITS_WITHOUT_ONEDNN = dc.CpuBf16Facts("x86_64", "AVX512", True, True, onednn_bf16=False)


@pytest.mark.parametrize("cpu", [AVX2_EPYC, AVX512_NO_BF16, UNITS_WITHOUT_ONEDNN])
def test_auto_is_float32_where_the_cpu_emulates_bf16(cpu):
    name, reason = dc.choose_dtype("auto", "cpu", cpu)
    assert name == "float32"
    assert "emulated" in reason and cpu.capability in reason


@pytest.mark.parametrize("cpu", [SAPPHIRE_RAPIDS, COOPER_LAKE, GRAVITON3])
def test_auto_is_bfloat16_where_the_cpu_has_bf16_units(cpu):
    name, reason = dc.choose_dtype("auto", "cpu", cpu)
    assert name == "bfloat16"
    assert "native" in reason


def test_auto_is_bfloat16_on_cuda_whatever_the_host_cpu():
    assert dc.choose_dtype("auto", "cuda", None)[0] == "bfloat16"
    assert dc.choose_dtype("auto", "cuda", AVX2_EPYC)[0] == "bfloat16"


@pytest.mark.parametrize("requested", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("cpu", [AVX2_EPYC, SAPPHIRE_RAPIDS])
def test_an_explicit_dtype_is_honoured(requested, cpu):
    name, reason = dc.choose_dtype(requested, "cpu", cpu)
    assert name == requested
    assert "set in the config" in reason
    emulated = requested == "bfloat16" and cpu is AVX2_EPYC
    assert ("emulated" in reason) is emulated


def test_bad_requests_fail_clearly():
    with pytest.raises(ValueError, match="profile.dtype: 'fp8'"):
        dc.choose_dtype("fp8", "cpu", AVX2_EPYC)
    with pytest.raises(ValueError, match="CPU's facts"):
        dc.choose_dtype("auto", "cpu", None)


def test_the_facts_come_from_torch(monkeypatch):
    monkeypatch.setattr(dc.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert dc.cpu_bf16_facts() == AVX2_EPYC

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert dc.cpu_bf16_facts().native_bf16


def test_a_missing_torch_check_counts_as_no_bf16(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert dc.cpu_bf16_facts().amx_bf16 is False


PROFILE = {
    "device": "cpu",
    "allow_cpu": True,
    "micro_batch_size": None,
    "seed": 0,
    "cpu": {"lengths": [32, 64, 128], "warmup": 1, "repeats": 2, "kernel_steps": 1},
}
TRAINING = {"micro_batch_size": 2, "max_seq_len": 256}


def resolve(dtype: str):
    """The profile's settings for PROFILE with `dtype`, from the typed sections."""
    cfg = workflow_config(profile={**PROFILE, "dtype": dtype}, training=TRAINING)
    return pp.resolve_settings(cfg.profile, cfg.training)


@pytest.mark.parametrize(
    ("cpu", "expected"), [(AVX2_EPYC, torch.float32), (SAPPHIRE_RAPIDS, torch.bfloat16)]
)
def test_settings_resolve_auto_from_the_cpu(monkeypatch, cpu, expected):
    monkeypatch.setattr(dc, "cpu_bf16_facts", lambda: cpu)
    settings = resolve("auto")
    assert settings.dtype == expected
    assert settings.dtype_reason.startswith("auto:")


def test_settings_warn_when_an_explicit_bf16_is_emulated(monkeypatch, caplog):
    monkeypatch.setattr(dc, "cpu_bf16_facts", lambda: AVX2_EPYC)
    with caplog.at_level(logging.WARNING, logger="probes.dtype"):
        settings = resolve("bfloat16")
    assert settings.dtype == torch.bfloat16
    assert "emulated" in settings.dtype_reason
    assert any("emulated" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_settings_do_not_warn_where_bf16_is_native(monkeypatch, caplog):
    monkeypatch.setattr(dc, "cpu_bf16_facts", lambda: SAPPHIRE_RAPIDS)
    with caplog.at_level(logging.WARNING, logger="probes.dtype"):
        resolve("bfloat16")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]

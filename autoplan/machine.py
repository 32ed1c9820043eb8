"""The machine autoplan runs on, in the terms a device profile records (cost_models.profile.DeviceIdentity),
and whether a profile describes it.

Why: a profile's times hold on the device it was measured on or describes. A CPU profile measured where
bf16 matmuls run on matrix units (AMX, AVX512-BF16) says nothing about a CPU that emulates them on AVX2
(a gpt2 step ran 75x slower than predicted there), and a plan priced for an A100 does not time an H100. So
`search` and `apply` say when this machine is not the profile's device, and, on a CPU without bf16 matrix
units, that a bf16 plan will run far slower than priced and fp32 will not.

Reading a profile never runs code; reading this machine reads /proc/cpuinfo and asks torch about the GPU.
"""

from __future__ import annotations

import os
import re

from cost_models.options import PRECISIONS, Dtype
from cost_models.profile import DeviceIdentity, DeviceProfile

__all__ = ["BF16_MATRIX_FEATURES", "RECORDED_FEATURES", "bf16_note", "cpu_identity", "device_mismatch",
           "gpu_identity", "has_bf16_matrix_units", "machine_identity"]

# CPU flags (x86 /proc/cpuinfo "flags", ARM "Features") that decide op speed, the bf16 matrix ones first
BF16_MATRIX_FEATURES = ("amx_bf16", "avx512_bf16", "bf16")
RECORDED_FEATURES = ("amx_bf16", "avx512_bf16", "bf16", "avx512f", "avx2")
CPUINFO = "/proc/cpuinfo"


def _cpuinfo(path: str = CPUINFO) -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open(path) as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:  # the first processor's block is enough
                    break
    except OSError:
        pass
    return fields


def cpu_identity(path: str = CPUINFO) -> DeviceIdentity:
    """This host's CPU: its model name, cores and the features of RECORDED_FEATURES it has."""
    import platform

    info = _cpuinfo(path)
    model = info.get("model name") or info.get("Model") or platform.processor() or platform.machine()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return DeviceIdentity(name=model, cpu_model=model, cpu_cores=os.cpu_count(),
                          cpu_features=[f for f in RECORDED_FEATURES if f in flags])


def gpu_identity(index: int = 0) -> DeviceIdentity | None:
    """GPU `index` of this machine (None without CUDA): name, memory, SMs, and where NVML answers (the
    nvidia-ml-py package) its maximum SM clock and power limit."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    clock = watts = None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        clock = float(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
        watts = pynvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000
    except Exception:  # no NVML here: the clock and power stay unknown
        pass
    host = cpu_identity()
    return DeviceIdentity(name=props.name, memory_bytes=props.total_memory, sm_count=props.multi_processor_count,
                          boost_clock_mhz=clock, power_limit_w=watts, cpu_model=host.cpu_model,
                          cpu_cores=host.cpu_cores, cpu_features=host.cpu_features)


def machine_identity(device_type: str) -> DeviceIdentity | None:
    """This machine's device of that type: its CPU, or its first GPU (None where it has none)."""
    return cpu_identity() if device_type == "cpu" else gpu_identity()


def has_bf16_matrix_units(identity: DeviceIdentity) -> bool:
    return any(feature in identity.cpu_features for feature in BF16_MATRIX_FEATURES)


def _key(name: str) -> str:
    name = re.sub(r"\((r|tm)\)|\b(cpu|processor|nvidia)\b|@.*$", " ", name.lower())
    return " ".join(name.split())


def _described(profile: DeviceProfile) -> DeviceIdentity | None:
    if profile.identity is not None:
        return profile.identity
    name = profile.provenance.device_name
    return DeviceIdentity(name=name) if name else None


def _features(identity: DeviceIdentity) -> str:
    return f" ({', '.join(identity.cpu_features) or 'none of ' + '/'.join(RECORDED_FEATURES)})"


def device_mismatch(profile: DeviceProfile, here: DeviceIdentity | None = None) -> str | None:
    """What to say when this machine is not the device `profile` describes, or None when it is (or when this
    machine has no device of the profile's kind: a GPU cluster is planned from a laptop). A CPU profile and
    this CPU differ when their models differ, or, where the profile recorded its features, when one has bf16
    matrix units and the other not."""
    here = here if here is not None else machine_identity(profile.device_type)
    there = _described(profile)
    if here is None or there is None:
        return None
    same = _key(there.name) == _key(here.name)
    if profile.device_type == "cpu" and there.cpu_features:
        same = same and has_bf16_matrix_units(there) == has_bf16_matrix_units(here)
    if same:
        return None
    described = "measured on" if profile.source == "measured" else "describes"
    cpu = profile.device_type == "cpu"
    return (f"profile {profile.name} {described} {there.name}{_features(there) if cpu and there.cpu_features else ''}, "
            f"this machine is {here.name}{_features(here) if cpu else ''}: its step times may not hold here; run "
            f"`autoplan profile` to measure this machine")


def bf16_note(profile: DeviceProfile, dtype: str, here: DeviceIdentity | None = None) -> str | None:
    """On a CPU without bf16 matrix units, what a bf16 plan on a CPU profile will do (and what to do instead)."""
    if profile.device_type != "cpu" or dtype not in PRECISIONS or PRECISIONS[dtype].compute_dtype is not Dtype.BF16:
        return None
    here = here if here is not None else cpu_identity()
    if has_bf16_matrix_units(here):
        return None
    return (f"this CPU ({here.name}{_features(here)}) has no bf16 matrix units: its bf16 matmuls are emulated, many "
            f"times slower than profile {profile.name} prices them (a gpt2 step took 75x its prediction on such a CPU); "
            f"plan with `dtype` fp32")

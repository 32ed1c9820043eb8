"""This machine against the device a profile describes (autoplan/machine.py): `search`, `estimate` and `apply`
warn when they differ (another CPU, another GPU) and say what to do; on a CPU without bf16 matrix units a bf16
CPU plan says it will run emulated, and fp32 does not."""

import pytest

import autoplan.machine as machine
from autoplan.cli.main import main
from autoplan.machine import bf16_note, cpu_identity, device_mismatch
from autoplan.profile_store import load_profile
from autoplan.run.prepare import RunOptions, prepare_run, run_outline
from cost_models.profile import DeviceIdentity

AVX2_ONLY = DeviceIdentity(name="Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz", cpu_model="Intel(R) Core(TM) i7-8700 CPU",
                           cpu_cores=12, cpu_features=["avx2"])
SEARCH = ["search", "--model", "gpt2-tiny", "--gpus", "2", "--mem", "1GB", "--seq-len", "64", "--profile", "cpu-gloo-2"]


@pytest.fixture
def another_cpu(monkeypatch):
    """This machine as an AVX2-only desktop CPU: neither the profile's CPU nor one with bf16 matrix units."""
    monkeypatch.setattr(machine, "cpu_identity", lambda *a: AVX2_ONLY)
    return AVX2_ONLY


@pytest.fixture
def the_profiles_cpu(monkeypatch):
    profile = load_profile("cpu-gloo-2")
    here = profile.identity.model_copy(update={"cpu_features": ["amx_bf16", "avx512_bf16", "avx512f", "avx2"]})
    monkeypatch.setattr(machine, "cpu_identity", lambda *a: here)
    return here


def test_this_cpu_is_read_with_its_matrix_and_vector_features(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n\n"
                       "processor\t: 1\nmodel name\t: AMD EPYC 9654\n")
    identity = cpu_identity(str(cpuinfo))
    assert identity.name == "AMD EPYC 9654" and identity.cpu_features == ["avx512_bf16", "avx512f", "avx2"]
    assert machine.has_bf16_matrix_units(identity) and not machine.has_bf16_matrix_units(AVX2_ONLY)


def test_a_profile_of_another_cpu_is_named_with_this_one_and_what_to_do(another_cpu):
    profile = load_profile("cpu-gloo-2")
    message = device_mismatch(profile)
    assert message.startswith(f"profile cpu-gloo-2 measured on {profile.identity.name}")
    assert f"this machine is {AVX2_ONLY.name} (avx2)" in message and "run `autoplan profile`" in message


def test_the_profiles_own_device_draws_no_warning(the_profiles_cpu):
    assert device_mismatch(load_profile("cpu-gloo-2")) is None


def test_a_gpu_profile_warns_on_a_machine_with_another_gpu_and_not_on_one_without(monkeypatch):
    a100 = load_profile("a100-sxm4-80gb")
    monkeypatch.setattr(machine, "gpu_identity", lambda *a: None)  # a laptop planning for a cluster
    assert device_mismatch(a100) is None
    h100 = DeviceIdentity(name="NVIDIA H100 80GB HBM3", memory_bytes=85520809984, sm_count=132)
    monkeypatch.setattr(machine, "gpu_identity", lambda *a: h100)
    assert "this machine is NVIDIA H100 80GB HBM3" in device_mismatch(a100)
    assert device_mismatch(load_profile("h100-sxm-80gb")) is None


def test_search_warns_of_another_device_and_of_emulated_bf16(another_cpu, capsys, tmp_path):
    assert main([*SEARCH, "-o", str(tmp_path / "plan.json")]) == 0
    err = capsys.readouterr().err
    assert "autoplan search: warning: profile cpu-gloo-2 measured on" in err
    assert "has no bf16 matrix units" in err and "plan with --dtype fp32" in err
    assert main([*SEARCH, "--dtype", "fp32", "-o", str(tmp_path / "fp32.json")]) == 0
    err = capsys.readouterr().err
    assert "measured on" in err and "bf16 matrix units" not in err  # fp32 runs as priced, on this CPU's units


def test_estimate_says_the_same(another_cpu, capsys):
    assert main(["estimate", "--model", "gpt2-tiny", "--gpus", "2", "--seq-len", "64", "--profile", "cpu-gloo-2"]) == 0
    assert "autoplan estimate: warning: profile cpu-gloo-2 measured on" in capsys.readouterr().err


def test_apply_warns_and_its_time_estimate_says_it_may_not_hold(another_cpu, capsys, tmp_path):
    plan = tmp_path / "plan.json"
    assert main([*SEARCH, "-o", str(plan)]) == 0
    prepared = prepare_run(str(plan), RunOptions(steps=2, warmup=1))
    assert any(w.startswith("profile cpu-gloo-2 measured on") for w in prepared.warnings)
    assert any("bf16 matrix units" in w and "--dtype fp32" in w for w in prepared.warnings)
    [estimate] = [line for line in run_outline(prepared) if line.startswith("estimate:")]
    assert "it may not hold: this machine is not the device" in estimate


def test_on_the_profiles_own_cpu_apply_says_nothing_of_the_device(the_profiles_cpu, tmp_path):
    plan = tmp_path / "plan.json"
    assert main([*SEARCH, "-o", str(plan)]) == 0
    prepared = prepare_run(str(plan), RunOptions(steps=2, warmup=1))
    assert not any("measured on" in w or "bf16" in w for w in prepared.warnings)
    assert not any("may not hold" in line for line in run_outline(prepared))


def test_bf16_on_a_cpu_profile_only(another_cpu):
    assert bf16_note(load_profile("a100-sxm4-80gb"), "bf16-mixed") is None  # a GPU plan: not this CPU's business
    assert bf16_note(load_profile("cpu-gloo-2"), "fp32") is None
    assert "emulated" in bf16_note(load_profile("cpu-gloo-2"), "bf16")


def test_profile_measures_fp32_alone_on_a_cpu_without_bf16_units(another_cpu, capsys):
    import argparse

    from autoplan.cli import profile as cli_profile

    parser = argparse.ArgumentParser()
    cli_profile.register(parser.add_subparsers(dest="command"))
    settings = cli_profile.settings_from_args(parser.parse_args(["profile", "--no-cache"]))
    assert settings.dtypes == ("fp32",) and "no bf16 matrix units" in capsys.readouterr().err
    asked = cli_profile.settings_from_args(parser.parse_args(["profile", "--no-cache", "--dtype", "fp32", "bf16"]))
    assert asked.dtypes == ("fp32", "bf16")  # named on the command line: measured as asked


def test_profile_keeps_bf16_where_the_cpu_has_the_units(the_profiles_cpu):
    import argparse

    from autoplan.cli import profile as cli_profile

    parser = argparse.ArgumentParser()
    cli_profile.register(parser.add_subparsers(dest="command"))
    assert cli_profile.settings_from_args(parser.parse_args(["profile", "--no-cache"])).dtypes == ("fp32", "bf16")

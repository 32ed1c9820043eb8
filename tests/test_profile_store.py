"""Which profile a name picks: a shipped name always the shipped profile (a local file of the same name,
such as a rough `--quick` measurement, never changes what the name means), `local:NAME` or a path the
local one; `autoplan profiles` lists both and says so, and prints where each profile's figures come from
(`provenance.sources`); `autoplan profile` names its output so that it never lands under a shipped name by
default. Nothing here measures anything."""

import argparse
import re

import pytest

import autoplan
from autoplan.cli import profile as cli_profile
from autoplan.cli.main import main
from autoplan.errors import UsageError
from autoplan.profile_store import (
    available_profiles,
    figure_value,
    load_profile,
    save_profile,
    shipped_profile_dir,
    sourced_figures,
)
from cost_models.comm import CommModel


@pytest.fixture
def local_dir(tmp_path, monkeypatch):
    folder = tmp_path / "local-profiles"
    folder.mkdir()
    monkeypatch.setenv("AUTOPLAN_PROFILE_DIR", str(folder))
    return folder


def _rough_cpu_gloo_2(local_dir):
    """A local file named like the shipped measured profile, as `profile --quick` used to write it."""
    shipped = load_profile("cpu-gloo-2")
    rough = shipped.model_copy(update={"op_times": shipped.op_times[:46], "mem_bytes": 12345 << 20})
    save_profile(rough, local_dir / "cpu-gloo-2.json")
    return shipped, rough


def test_a_shipped_name_picks_the_shipped_profile_and_local_names_the_local_one(local_dir):
    shipped, rough = _rough_cpu_gloo_2(local_dir)
    assert load_profile("cpu-gloo-2") == shipped
    assert load_profile("local:cpu-gloo-2") == rough
    assert load_profile(str(local_dir / "cpu-gloo-2.json")) == rough
    profiles = available_profiles()
    assert profiles["cpu-gloo-2"] == shipped_profile_dir() / "cpu-gloo-2.json"
    assert profiles["local:cpu-gloo-2"] == local_dir / "cpu-gloo-2.json"
    # a local profile no shipped one is named like loads by its bare name, and as local:NAME
    save_profile(rough.model_copy(update={"name": "mine"}), local_dir / "mine.json")
    assert load_profile("mine").name == load_profile("local:mine").name == "mine"
    with pytest.raises(UsageError, match="no local profile 'nothing'"):
        load_profile("local:nothing")


def test_the_api_plans_with_the_profile_the_name_picks(local_dir):
    _, rough = _rough_cpu_gloo_2(local_dir)
    by_name = autoplan.estimate("gpt2-tiny", "shard", gpus=2, seq_len=64, profile="cpu-gloo-2")
    local = autoplan.estimate("gpt2-tiny", "shard", gpus=2, seq_len=64, profile="local:cpu-gloo-2")
    assert by_name.cluster.device_mem_bytes == load_profile("cpu-gloo-2").mem_bytes != rough.mem_bytes
    assert local.cluster.device_mem_bytes == rough.mem_bytes


def test_profiles_lists_both_and_says_which_the_name_picks(local_dir, capsys):
    _rough_cpu_gloo_2(local_dir)
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert re.search(r"^cpu-gloo-2\s+shipped\s+measured\s+cpu .* a local one is local:cpu-gloo-2$", rows["cpu-gloo-2"])
    assert re.search(r"^local:cpu-gloo-2\s+local\s+measured\s+cpu .* cpu-gloo-2 picks the shipped one$",
                     rows["local:cpu-gloo-2"])
    assert "a shipped profile's name always picks the shipped profile" in out
    assert str(local_dir) in out


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli_profile.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["profile", *argv])


@pytest.mark.parametrize("argv, name", [
    (("--quick",), "cpu-gloo-2-quick"),  # its own name: never a full profile's
    ((), "cpu-gloo-2-local"),  # the shipped profile has cpu-gloo-2: in the local folder it would be hidden
    (("--nproc", "4"), "cpu-gloo-4"),  # no shipped profile of that name
    (("-o", "profiles/cpu-gloo-2.json"), "cpu-gloo-2"),  # a file elsewhere (how the shipped one is made)
    (("--name", "mine", "--quick"), "mine"),
])
def test_default_profile_names(argv, name, local_dir):
    assert cli_profile.settings_from_args(_parse(*argv, "--no-cache")).name == name


def test_profile_refuses_an_output_it_cannot_write_before_measuring(tmp_path, capsys):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    assert main(["profile", "--quick", "--no-cache", "--no-progress", "-o", str(folder)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_quick_help_says_how_long_it_takes(capsys):
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert cli_profile.QUICK_TIME in help_text and "-quick" in help_text
    assert "rough, seconds" not in help_text


def test_every_source_names_a_figure_of_its_profile():
    # a source under a path the profile does not have would print a figure that is not there
    for name in ("a100-sxm4-80gb", "h100-sxm-80gb", "v100-sxm2-32gb", "cpu-gloo-2", *RENTED_GPUS):
        profile = load_profile(name)
        for path, value, source in sourced_figures(profile):
            # None says "not fixed here": host memory left to --host-mem, the recompute at the backward's scale
            assert source and (value is not None or path in ("host_link.host_mem_bytes",
                                                             "fsdp.compute_recompute_scale")), (name, path)
    a100 = load_profile("a100-sxm4-80gb")
    assert figure_value(a100, "links.inter_node.bus_bandwidth_bytes_s") == a100.links["inter_node"].bus_bandwidth_bytes_s
    assert figure_value(a100, "links.nowhere.latency_s") is None


def test_gpu_profiles_carry_sourced_achievable_figures():
    for name in ("a100-sxm4-80gb", "h100-sxm-80gb", "v100-sxm2-32gb", *RENTED_GPUS):
        sources = load_profile(name).provenance.sources
        for figure in ("matmul_efficiency", "mem_bandwidth_efficiency", "links.inter_node.bus_bandwidth_bytes_s",
                       "collectives", "host_link.h2d_bytes_s", "host_link.host_mem_bytes"):
            assert figure in sources, (name, figure)
    for name in RENTED_GPUS:  # the time model's kernel, network and identity figures, each sourced
        profile = load_profile(name)
        for figure in ("identity", "matmul", "attention", "overlap.comm_sm_fraction", "topology", "peak_flops"):
            assert figure in profile.provenance.sources, (name, figure)
        assert profile.identity.sm_count == profile.matmul.sm_count and profile.attention
    a100 = load_profile("a100-sxm4-80gb")
    # whole-node rings across DGX A100s run at the node's 8 NICs (8 x 24 GB/s), not at one NIC's 24 GB/s; an HSDP
    # replica group (one rank per node, eight groups side by side) gets one NIC's share
    comm, size = CommModel(a100, gpus_per_node=8), 4 << 30
    whole = comm.collective_s("all_gather", size, 64, "inter_node")
    assert 150e9 < 63 / 64 * size / whole < 200e9
    replica = comm.collective_s("all_reduce", size, 8, "inter_node", ranks_per_node=1)
    assert 20e9 < 2 * 7 / 8 * size / replica < 25e9
    assert "24 GB/s each" in a100.provenance.sources["topology"]


RENTED_GPUS = ("a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm-80gb", "h100-pcie-80gb", "h100-nvl-94gb", "h200-sxm-141gb")


def test_profiles_counts_each_profiles_sources(local_dir, capsys):
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    for name in ("a100-sxm4-80gb", "cpu-gloo-2"):
        assert rows[name][-1] == str(len(load_profile(name).provenance.sources))
    assert "`autoplan profiles NAME`" in out


def test_profiles_name_prints_each_figure_with_its_value_and_source(local_dir, capsys):
    assert main(["profiles", "a100-sxm4-80gb"]) == 0
    out = capsys.readouterr().out
    for path in load_profile("a100-sxm4-80gb").provenance.sources:
        assert f"\n  {path}: " in out, path
    assert "matmul_efficiency: 86.9%" in out and "Maximum Achievable Matmul FLOPS" in " ".join(out.split())
    assert "links.inter_node.bus_bandwidth_bytes_s: 24.00 GB/s" in out


def test_profiles_verbose_prints_every_profile_and_says_when_none_is_sourced(local_dir, capsys):
    bare = load_profile("cpu-gloo-2")
    bare = bare.model_copy(update={"name": "bare", "provenance": bare.provenance.model_copy(update={"sources": {}})})
    save_profile(bare, local_dir / "bare.json")
    assert main(["profiles", "--verbose"]) == 0
    out = capsys.readouterr().out
    for name in ("a100-sxm4-80gb", "h100-sxm-80gb", "v100-sxm2-32gb", "cpu-gloo-2", "bare"):
        assert f"\n{name} (" in out, name
    assert "no figure names its source" in out
    assert main(["profiles", "no-such-profile"]) == 2
    assert "unknown profile 'no-such-profile'" in capsys.readouterr().err

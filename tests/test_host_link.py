"""The host link a measured profile carries (autoplan/profiling/host_link.py): on the CPU a memcpy, no copy
beside compute, the host's optimizer rate with the rank's threads, the host's memory left to the search;
and a one-process profile (`--nproc 1`, a one-GPU machine) that measures no collectives takes its links,
collective fits and overlap from another profile and says so in its sources."""

import json

import pytest
import torch

from autoplan.cli.main import main
from autoplan.profile_store import load_profile
from autoplan.profiling.host_link import measure_host_link
from autoplan.profiling.timing import Repeats
from cost_models.profile import HostLink

FEW = Repeats(warmup=1, min_repeats=2, max_repeats=3, min_time_s=0.0)


def test_cpu_host_link_is_a_memcpy_beside_nothing():
    host = measure_host_link(torch.device("cpu"), FEW, threads=1, nbytes=8 << 20)
    link = HostLink(**{field: host[field] for field in HostLink.model_fields})
    assert link.h2d_bytes_s == link.d2h_bytes_s > 1e8  # any machine copies 8 MiB faster than 100 MB/s
    assert not link.overlaps_compute and link.host_mem_bytes is None and link.cpu_threads == 1
    assert link.cpu_optimizer_bytes_s > 1e8 and host["copy_bytes"] == 8 << 20


def test_cpu_host_link_reuses_the_devices_optimizer_rate():
    host = measure_host_link(torch.device("cpu"), FEW, threads=2, nbytes=1 << 20, device_adamw_bytes_s=1.25e9)
    assert host["cpu_optimizer_bytes_s"] == 1.25e9 and host["cpu_threads"] == 2


def test_shipped_profiles_carry_a_sourced_host_link():
    for name in ("a100-sxm4-80gb", "h100-sxm-80gb", "v100-sxm2-32gb", "cpu-gloo-2"):
        profile = load_profile(name)
        assert profile.host_link is not None, name
        for field in HostLink.model_fields:
            assert f"host_link.{field}" in profile.provenance.sources, (name, field)
    # PCIe Gen5 (H100) moves about twice what Gen4 (A100) does, Gen4 twice Gen3 (V100)
    h100, a100, v100 = (load_profile(n).host_link.h2d_bytes_s for n in ("h100-sxm-80gb", "a100-sxm4-80gb",
                                                                           "v100-sxm2-32gb"))
    assert 1.5 < h100 / a100 < 2.5 and 1.5 < a100 / v100 < 2.5
    assert load_profile("cpu-gloo-2").host_link.host_mem_bytes is None  # the search takes this machine's


@pytest.mark.slow
@pytest.mark.distributed
def test_one_process_profile_takes_its_links_from_another(tmp_path, capsys):
    out = tmp_path / "one.json"
    code = main(["profile", "--nproc", "1", "--quick", "--links-from", "cpu-gloo-2", "--cache-dir",
                 str(tmp_path / "cache"), "--no-progress", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    profile, reference = load_profile(str(out)), load_profile("cpu-gloo-2")
    assert profile.name == "cpu-gloo-1-quick" and profile.host_link is not None
    assert profile.links == reference.links and profile.collectives == reference.collectives
    assert profile.overlap == reference.overlap
    for field in ("links", "collectives", "overlap"):
        assert "taken from profile 'cpu-gloo-2'" in profile.provenance.sources[field]
    assert "memcpy" in profile.provenance.sources["host_link.h2d_bytes_s"]
    assert "host link:" in capsys.readouterr().out
    assert json.loads(out.read_text())["host_link"]["overlaps_compute"] is False

"""CPU ranks keep the memory they free mapped (autoplan.run.host_memory): once the heap has grown to a
step's needs, a training loop takes (almost) no page faults, as a GPU run's caching allocator takes no new
segments after its first steps. Checked in child processes (the setting lasts for the process), through
the public function, against glibc's default, which maps a large tensor fresh at every allocation."""

import subprocess
import sys
import textwrap

import pytest

_LOOP = textwrap.dedent("""
    import resource, sys, torch
    from autoplan.run.host_memory import keep_freed_memory
    kept = keep_freed_memory() if sys.argv[1] == "kept" else None
    faults = []
    for step in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        # a step's large temporaries: above glibc's largest mmap threshold (48 MB) and below it (24 MB)
        big, small = torch.ones(12 << 20), torch.ones(6 << 20)
        del big, small
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(kept, sum(faults[6:]))  # the later steps: the heap has grown to what a step needs
""")


def _later_faults(mode: str) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", _LOOP, mode], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    kept, faults = done.stdout.split()
    return kept, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc knobs")
def test_freed_memory_stays_mapped_so_later_steps_take_few_page_faults():
    kept, faults = _later_faults("kept")
    _, default = _later_faults("default")
    assert kept == "True"
    assert default > 6 * 12_000  # glibc's default faults the 48 MB tensor's 12,288 pages in at every step
    assert faults < 0.3 * default  # kept: the heap's blocks are reused (now and then it grows a block)

"""recovery.pipeline.heapreuse: while a replay runs, glibc's malloc serves large tensors from its heap and
keeps freed pages for the next step; afterwards large blocks are mapped (and returned) again.

Each case runs in a new interpreter: malloc's settings belong to the process, and its dynamic
thresholds depend on what the process freed before."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

import recovery.pipeline.heapreuse as heapreuse

pytestmark = pytest.mark.skipif(
    heapreuse._glibc() is None or not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc 2.33+")

# Allocates a 64 MiB tensor four times (freeing it between) inside keep_freed_memory, then once
# after; reports where each lived (mapped bytes, glibc's hblkhd), the page faults of each, and the
# resident size just before and just after leaving. (A
# small allocation between two large ones may take the start of the freed block, so that the next
# large one grows the heap once more: reuse is checked on the later rounds, as a replay repeats.)
CHILD = r"""
import ctypes, json, resource, sys
import torch
from recovery.pipeline import heapreuse

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2

def mapped():
    return libc.mallinfo2().hblkhd

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def resident():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))

def allocate():
    before_mapped, before_faults = mapped(), faults()
    tensor = torch.ones(16 << 20)            # 64 MiB, every page written
    report = {"mapped": mapped() - before_mapped, "faults": faults() - before_faults}
    del tensor
    return report

out = {}
with heapreuse.keep_freed_memory():
    out["active"] = heapreuse.active()
    out["inside"] = [allocate() for _ in range(4)]
    out["resident_inside"] = resident()
out["resident_after"] = resident()
out["active_after"] = heapreuse.active()
out["after"] = allocate()
print(json.dumps(out))
"""

PAGES = (64 << 20) // 4096


def run_child(**env) -> dict:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("LOWDIFF_MALLOC_TUNING", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")}
    environment.update(env)
    result = subprocess.run([sys.executable, "-c", CHILD], env=environment, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_freed_pages_are_reused_inside_and_large_blocks_mapped_again_after():
    out = run_child()
    assert out["active"] and not out["active_after"]
    # Inside: from the heap (nothing mapped), and later tensors reuse the pages of earlier ones.
    assert all(each["mapped"] == 0 for each in out["inside"]), out
    assert out["inside"][0]["faults"] >= PAGES * 0.9
    assert min(each["faults"] for each in out["inside"][1:]) < PAGES * 0.1, out
    # Leaving returns the kept pages to the system...
    assert out["resident_inside"] - out["resident_after"] >= 48 << 20, out
    # ...so the next large block is not served from kept pages: either it is mapped again, or (when
    # a freed chunk of the heap fits it, which glibc prefers to a mapping) its pages fault in anew.
    assert out["after"]["mapped"] >= 64 << 20 or out["after"]["faults"] >= PAGES * 0.9, out


def test_switched_off_by_the_variable_malloc_is_left_alone():
    out = run_child(LOWDIFF_MALLOC_TUNING="0")
    assert not out["active"]
    assert all(each["mapped"] >= 64 << 20 and each["faults"] >= PAGES * 0.9 for each in out["inside"]), out


@pytest.mark.parametrize("setting", [{"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"},
                                     {"MALLOC_MMAP_MAX_": "65536"}])
def test_a_users_own_malloc_settings_are_left_alone(setting):
    assert not run_child(**setting)["active"]


def test_nesting_restores_once_the_outermost_leaves():
    if not heapreuse.tuning_allowed():
        pytest.skip("malloc tuning is switched off in this environment")
    with heapreuse.keep_freed_memory():
        with heapreuse.keep_freed_memory():
            assert heapreuse.active()
        assert heapreuse.active()
    assert not heapreuse.active()

"""lowdiff.distributed.dtensors keeps a DTensor's chunk entry and replica group by spec: what it
returns from there equals what it computes afresh, for the same spec again, after a redistribute
(a new spec), and for DTensors made and dropped at every step (ids reused). One gloo process."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, socket, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from lowdiff.distributed import dtensors
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))

    def fresh(t):
        return dtensors._chunk_entry(t), dtensors._replica_group(t)

    def kept(t):
        return dtensors.chunk_entry(t), dtensors.replica_group(t)

    sharded = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(1)])
    assert kept(sharded) == fresh(sharded) and kept(sharded)[0]["placements"] == ["S1"]
    assert kept(sharded) == fresh(sharded)                           # found again
    entry = dtensors.chunk_entry(sharded)
    entry["placements"] = ["changed by a caller"]                    # a new dict each time
    assert dtensors.chunk_entry(sharded)["placements"] == ["S1"]
    replicated = sharded.redistribute(mesh, [Replicate()])
    assert replicated._spec is not sharded._spec
    assert kept(replicated) == fresh(replicated) and kept(replicated)[0]["placements"] == ["R"]
    assert kept(sharded)[0]["placements"] == ["S1"]
    for n in range(1, 200):                                          # made and dropped: ids come back
        t = distribute_tensor(torch.zeros(n, 2), mesh, [Shard(n % 2)])
        assert kept(t) == fresh(t), n
        assert kept(t)[0]["global_shape"] == [n, 2] and kept(t)[0]["placements"] == [f"S{n % 2}"]
    dist.destroy_process_group()
    print("ok")
    sys.stdout.flush()
    os._exit(0)   # torch 2.13 + gloo may abort at interpreter exit after the teardown (docs/guide.md)
""")


def test_chunk_entries_kept_by_spec_equal_fresh_ones():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]

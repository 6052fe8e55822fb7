"""One rank that tries lowdiff.wrap on sharded training lowdiff cannot record (FSDP1, ZeRO, FSDP2
settings, tensor parallelism, FSDP2 + tensor parallelism on a 2-D mesh) and on what it can (FSDP2 on
a 1-D mesh, HSDP), and reports what
wrap() did: one JSON line per case on stdout, {"case", "error" (exception type or null), "message",
"files" (what the directory holds after)}. Used by test_fsdp2_refusals.py."""
import argparse
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

import lowdiff


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def case_plain():
    model = mlp()
    return torch.optim.AdamW(model.parameters(), lr=1e-2), model


def case_fsdp2():   # the reproduction: fully_shard on each Linear and the root
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return torch.optim.AdamW(model.parameters(), lr=1e-2), model


def case_fsdp2_replica():   # case_fsdp2 wrapped in replica mode
    return case_fsdp2()


def case_hsdp():   # a 2-D mesh (replicate, shard): HSDP, recorded
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    model = mlp()
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh)
    return torch.optim.AdamW(model.parameters(), lr=1e-2), model


def case_fsdp2_tp():   # FSDP2 + tensor parallelism on a 2-D (dp, tp) mesh: refused
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = mlp()
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return torch.optim.AdamW(model.parameters(), lr=1e-2), model


def case_fsdp2_mixed():   # bfloat16 compute on one module: the optimizer steps float32 chunks, accepted
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = mlp()
    fully_shard(model[2], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model)
    return torch.optim.AdamW(model.parameters(), lr=1e-2), model


def case_fsdp2_offload():
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    model = mlp()
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return torch.optim.AdamW(model.parameters(), lr=1e-2), model


def case_fsdp2_default_policies():   # what the refusals' messages tell the user to write instead
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    model = mlp()
    fully_shard(model[2], mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy())
    fully_shard(model, mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy())
    return torch.optim.AdamW(model.parameters(), lr=1e-2), model


def case_fsdp2_own_dtype_policy():   # torchtitan's policy on a float32 model: casts nothing, accepted
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = mlp()
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    fully_shard(model[2], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return torch.optim.AdamW(model.parameters(), lr=1e-2), model


def case_fsdp2_reduce_bf16():   # gradients reduced in bfloat16, cast back before .grad: accepted
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = mlp()
    fully_shard(model[2], mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    fully_shard(model)
    return torch.optim.AdamW(model.parameters(), lr=1e-2), model


def case_fsdp1():
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "switching to NO_SHARD" at world size 1
        model[2] = FullyShardedDataParallel(model[2], device_id=torch.device("cpu"))
    return torch.optim.AdamW(model.parameters(), lr=1e-2), model


def case_zero():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = mlp()
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1), model


def case_partial():
    from torch.distributed.tensor import DTensor, Partial, init_device_mesh

    model = mlp()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model[2].weight = torch.nn.Parameter(DTensor.from_local(model[2].weight.detach(), mesh, [Partial()]))
    return torch.optim.SGD(model.parameters(), lr=0.1), model


def case_tensor_parallel():
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = mlp()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {"0": ColwiseParallel()})
    return torch.optim.SGD(model.parameters(), lr=0.1), model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--cases", required=True, help="comma-separated names of case_* functions")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    for name in args.cases.split(","):
        directory = os.path.join(args.dir, name)
        optimizer, model = globals()[f"case_{name}"]()
        report = {"case": name, "error": None, "message": ""}
        when = {"schedule": lowdiff.Replica(full_every=2, batch_steps=1)} if name == "fsdp2_replica" else \
            {"full_every": 2, "batch_steps": 1}
        try:
            wrapped = lowdiff.wrap(optimizer, model, directory, compressor=lowdiff.Dense(), **when)
        except Exception as exc:   # reported, judged by the test
            report.update(error=type(exc).__name__, message=str(exc))
        else:
            wrapped.close()
        report["files"] = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        print(json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)   # torch 2.13 + gloo abort at interpreter exit


if __name__ == "__main__":
    main()

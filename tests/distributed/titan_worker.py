"""One rank of torchtitan's own Trainer (torchtitan 0.3.0, llama3 "debugmodel", FSDP2 over 2 gloo
ranks on CPU) with lowdiff.integrations.torchtitan.LowDiffCheckpointManager as its checkpointer; used
by test_torchtitan.py (launched by partition_runs.launch).

Trainer.train() runs unchanged. Each line of --digests: "STEP DIGEST", DIGEST hashing everything this
rank holds after the step (its chunks of the parameters and AdamW state, the param groups, the LR
schedulers, the dataloader's position, the trainer's step and token count, the RNG); the first line
is "resumed STEP DIGEST" (what load() restored). With --crash-at K every rank SIGKILLs itself after
step K's save() (as torchrun kills a job), without flushing.

CPU shims (torchtitan 0.3.0 assumes an accelerator): torch._utils._get_available_device_type says
"cpu" (torchtitan takes "cuda" when it returns None, and torch.cuda.set_device fails on a CPU build);
FSDP2 reduces gradients with a plain sum (gloo has no
PREMUL_SUM); the metrics' device-memory monitor, which reads torch.cuda memory statistics, is a stub; the
process-group timeouts are left as they are (torchtitan's barrier passes a device index that
torch.cpu does not have). The model's attention is torchtitan's ScaledDotProductAttention (causal)
instead of its FlexAttention (block-causal per document), which has no backward on CPU
("FlexAttention does not support backward on CPU").
"""
import argparse
import hashlib
import logging
import os
import random
import signal
import sys

import torch
import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"

import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torchtitan.components import metrics  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

from lowdiff.integrations.torchtitan import LowDiffCheckpointManager  # noqa: E402


class CpuMemoryMonitor:
    """What MetricsProcessor asks of its device-memory monitor, for a CPU (no statistics)."""
    device_name = "cpu"
    device_capacity_gib = 0.0

    def get_peak_stats(self):
        return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self):
        pass


metrics.build_device_memory_monitor = CpuMemoryMonitor
# After the first step torchtitan shortens the process groups' timeouts behind a barrier with
# device_ids=[device_module.current_device()], which is "cpu" here (a device index is expected).
dist_utils.set_pg_timeouts = lambda **_: None


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def digest(trainer) -> str:
    h = hashlib.sha256()

    def add(t):
        t = local(t).detach().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode() + (t.view(-1).view(torch.uint8).numpy().tobytes()
                                                             if t.numel() else b""))
    for key, value in sorted(trainer.model_parts[0].state_dict().items()):
        h.update(key.encode())
        add(value)
    inner = trainer.checkpointer.optimizer.optimizer   # the AdamW torchtitan built
    state = inner.state_dict()
    for index in sorted(state["state"]):
        for key, value in sorted(state["state"][index].items()):
            h.update(f"{index}/{key}".encode())
            add(value) if isinstance(value, torch.Tensor) else h.update(repr(value).encode())
    h.update(repr(state["param_groups"]).encode())
    h.update(repr(trainer.lr_schedulers.state_dict()).encode())
    h.update(repr([s.get_last_lr() for s in trainer.lr_schedulers.schedulers]).encode())
    h.update(repr(trainer.dataloader.state_dict()).encode())
    h.update(repr(trainer.state_dict()).encode())
    add(torch.get_rng_state())
    h.update(repr(random.getstate()).encode())
    return h.hexdigest()


def full_state(trainer) -> dict:
    """The whole tensors of the model's parameters (by their own names: not state_dict()'s, whose
    hooks split the fused wqkv) and of the optimizer's state (by slot), gathered (a collective)."""
    def whole(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    params = {name: whole(p) for name, p in trainer.model_parts[0].named_parameters()}
    inner = trainer.checkpointer.optimizer.optimizer
    optimizer = {slot: {k: whole(v) if isinstance(v, torch.Tensor) else v for k, v in sorted(entry.items())}
                 for slot, entry in sorted(inner.state_dict()["state"].items())}
    return {"step": trainer.step, "params": params, "optimizer": optimizer}


def dump_state(trainer, path):
    state = full_state(trainer)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(state, path)


def build(args):
    config = llama3_debugmodel()
    for _, _, parent, field in list(config.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, field, ScaledDotProductAttention.Config())
    config.hf_assets_path = args.tokenizer
    config.dump_folder = args.dir
    config.dataloader.dataset_path = args.data
    config.training.steps = args.steps
    config.training.local_batch_size = 2
    config.training.seq_len = 32
    # torchtitan's fully_shard gets MixedPrecisionPolicy(param_dtype=this, reduce_dtype=float32): "bfloat16"
    # (its default) computes in bfloat16 while the optimizer steps float32 chunks, "float32" casts nothing
    config.training.mixed_precision_param = args.mixed_precision
    config.training.disable_cuda_graphs = True
    config.optimizer.implementation = "for-loop"        # "fused" is torchtitan's CUDA default
    config.activation_checkpoint = None
    # torchtitan's default, "spmd_types", hands fully_shard plain parameters with dp_mesh_dims, which
    # torch 2.13's FSDP2 refuses ("all parameters must be DTensors on the full SPMD mesh")
    config.parallelism.spmd_backend = "partial_dtensor"
    config.validator.enable = False
    config.metrics.log_freq = 1000
    config.comm.trace_buf_size = 0
    config.debug.seed = 0
    config.checkpoint = LowDiffCheckpointManager.Config(full_every=4, batch_steps=2, compressor=args.compressor,
                                                        keep_latest_k=0)
    return config.build()


def main():
    p = argparse.ArgumentParser()
    for name in ("rank", "world", "port", "steps"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--digests", required=True)
    p.add_argument("--tokenizer", required=True, help="a folder with tokenizer.json and tokenizer_config.json")
    p.add_argument("--data", required=True, help="a folder of JSON lines with a 'text' field")
    p.add_argument("--compressor", choices=["dense", "topk"], default="dense")
    p.add_argument("--mixed-precision", choices=["bfloat16", "float32"], default="bfloat16",
                   help="training.mixed_precision_param")
    p.add_argument("--crash-at", type=int)
    p.add_argument("--dump-states", help="write the gathered state after the --dump-steps to DUMP_STATES-STEP.pt")
    p.add_argument("--dump-steps", type=int, nargs="*", default=[])
    p.add_argument("--reshard-from", help="only resume this directory's model and optimizer state (no "
                                          "dataloader: torchtitan's refuses another dp degree) and write the "
                                          "gathered state to --dump-states")
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")   # lowdiff's warnings on stderr
    os.environ.update(RANK=str(args.rank), LOCAL_RANK=str(args.rank), WORLD_SIZE=str(args.world),
                      LOCAL_WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    random.seed(100 + args.rank)   # torchtitan seeds torch only; Python's RNG (which lowdiff restores) too
    trainer = build(args)
    # torchtitan sums gradients over ranks without FSDP's division (gradient_divide_factor 1.0, its
    # loss is already divided by the global token count); FSDP2 does that with
    # ReduceOp.PREMUL_SUM(1.0), which gloo lacks, or with a plain SUM when told to.
    for module in trainer.model_parts[0].modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            # the precision asked for is in force (compute in it, reduce in float32)
            policy = module._get_fsdp_state()._mp_policy
            assert str(policy.param_dtype) == f"torch.{args.mixed_precision}", policy
            assert policy.reduce_dtype == torch.float32, policy
    manager = trainer.checkpointer
    out = open(args.digests, "a")
    load, save = manager._load, manager._save

    def loaded(step=-1):
        restored = load(step)
        out.write(f"resumed {trainer.step} {digest(trainer)}\n")
        out.flush()
        return restored

    def saved(curr_step, last_step=False):
        done = save(curr_step, last_step)
        if curr_step in args.dump_steps:
            dump_state(trainer, f"{args.dump_states}-{curr_step}.pt")
        out.write(f"{curr_step} {digest(trainer)}\n")
        out.flush()
        if args.crash_at == curr_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    manager._load, manager._save = loaded, saved
    if args.reshard_from:
        import recovery
        step = recovery.resume(args.reshard_from, trainer.model_parts[0], manager.optimizer.optimizer)
        dump_state(trainer, f"{args.dump_states}-{int(step)}.pt")
        out.write(f"resharded {int(step)}\n")
    else:
        trainer.train()
    trainer.close()
    out.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)   # torch 2.13 + gloo abort at interpreter exit


if __name__ == "__main__":
    main()

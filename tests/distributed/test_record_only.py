"""Under DDP each rank scans only the gradients its share records (StepCapture.record_only);
outside DDP the compressor changes the gradient the optimizer uses, so every slot still runs."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, socket, sys, torch, torch.distributed as dist
    from lowdiff.step.compress import TopK
    from lowdiff.capture.stepcapture import StepCapture
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    for wrapped in (torch.nn.parallel.DistributedDataParallel(model), model):
        capture = StepCapture(torch.optim.SGD(model.parameters(), lr=0.1), wrapped, TopK(ratio=0.05))
        capture.record_only([0, 3])
        wrapped(torch.randn(4, 64)).sum().backward()
        before = [p.grad.clone() for p in model.parameters()]
        print(" ".join(g.kind for g in capture.compress_gradients()))
        if wrapped is not model:   # the aggregated gradient is recorded, never changed
            assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
        model.zero_grad()
    dist.destroy_process_group()
    # torch 2.13 + gloo may abort at interpreter exit after the teardown (docs/guide.md).
    sys.stdout.flush()
    os._exit(0)
""")


def test_ddp_records_only_its_shares_slots_and_plain_training_compresses_all():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ddp, plain = done.stdout.split("\n")[:2]
    # Slots 0..3: weight, bias (below TopK's min_numel: dense), weight, bias.
    assert ddp.split() == ["sparse", "none", "none", "sparse"]
    assert plain.split() == ["sparse", "dense", "sparse", "dense"]

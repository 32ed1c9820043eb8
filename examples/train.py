"""A team's own training loop with autoplan in it. Plan, then run under torchrun:

    autoplan search --model llama-tiny --gpus 2 --mem 40MB --seq-len 64 --profile cpu-gloo-2 -o plan.json
    torchrun --nproc-per-node 2 examples/train.py plan.json --steps 20 --save ckpt --save-every 10
    torchrun --nproc-per-node 1 examples/train.py plan1.json --steps 30 --resume ckpt/step-20  # another plan

The model, the data, the optimizer's settings, the LR schedule and the loop are the team's; autoplan
shards the model as the plan says and saves and loads sharded checkpoints (DCP reshards them for a plan
of other units, sharding or world size).
"""
import argparse
import functools
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import autoplan
from autoplan.models.zoo import build_model  # stands for the team's own model class

parser = argparse.ArgumentParser()
parser.add_argument("plan")
parser.add_argument("--model", default="llama-tiny"), parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--save"), parser.add_argument("--resume"), parser.add_argument("--save-every", type=int, default=5)
args = parser.parse_args()
cuda = torch.cuda.is_available()  # NCCL on GPUs, gloo on the CPU
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
dist.init_process_group("nccl" if cuda else "gloo")
plan, rank, world = autoplan.load_plan(args.plan), dist.get_rank(), dist.get_world_size()
# the script's mesh, named as the plan names its dimensions (a tensor-parallel plan: (world // tp, tp) named
# ("dp", "tp"), its loss under autoplan.run.tp.training_context(plan)); other dimensions are the script's own
mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
model, optimizer = applied = autoplan.apply(
    build_model(args.model), plan, mesh=mesh,  # built on the meta device: sharded before any memory is taken
    optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1),
    scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 5)))
autoplan.materialise(model, device, seed=0)
start = autoplan.load_checkpoint(args.resume, model, optimizer, scheduler=applied.scheduler).step if args.resume else 0
t, dp_rank, dp = plan.training, mesh["dp"].get_local_rank(), mesh["dp"].size()
for step in range(start, args.steps):
    generator, vocab = torch.Generator().manual_seed(step), model.config.vocab_size  # the team's data: counting
    starts = torch.randint(0, vocab, (t.global_batch_size, 1), generator=generator)
    tokens = (starts + torch.arange(t.seq_len + 1)) % vocab
    total = torch.zeros((), device=device)  # the global batch's loss
    for micro in range(t.global_batch_size // (t.micro_batch_size * dp)):
        rows = tokens[(micro * dp + dp_rank) * t.micro_batch_size:][:t.micro_batch_size].to(device)
        loss = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1).float(), rows[:, 1:].flatten())
        (loss / t.grad_accum_steps).backward()  # FSDP2 averages the gradients over the data-parallel ranks
        total += loss.detach() * t.micro_batch_size / t.global_batch_size
    optimizer.step(), applied.scheduler.step(), optimizer.zero_grad()
    dist.all_reduce(total)
    if rank == 0:
        print(f"step {step + 1} loss {total.item():.6f} lr {applied.scheduler.get_last_lr()[0]:.2e}", flush=True)
    if args.save and (step + 1) % args.save_every == 0:
        autoplan.save_checkpoint(f"{args.save}/step-{step + 1}", model, optimizer, step=step + 1,
                                 scheduler=applied.scheduler, plan=plan)
# FSDP2's state (its last collectives' work objects and buffers) released while the interpreter is whole, not in its
# teardown after the process group is gone (a 2-rank gloo run aborted there now and then); every rank done with its
# collectives before any tears down
del model, optimizer, applied
gc.collect()
dist.barrier(), dist.destroy_process_group()

"""A bare DeepSpeed loop: the reference for benchmark 5 (resilience overhead).

    torchrun --nproc_per_node 2 -m bench._bare_worker --steps 150 [key=value ...]

The same model, DeepSpeed config, data and thread settings as `python -m skyspot.trainer tiny`
(built with the trainer's own helpers), trained by the loop a blueprint would write: forward,
backward, step, `loss.item()`. No vote, no events, no checkpoints, no notice watcher, no signal
handlers. Rank 0 prints `BENCH_JSON {"step_ts": [...]}`: the time.time() at the end of each step.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._bare_worker")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    import deepspeed
    import torch
    import torch.distributed as dist

    from skyspot.recipe import load_recipe
    from skyspot.trainer import cluster
    from skyspot.trainer.data import build_samples
    from skyspot.trainer.determinism import configure_threads, seed_everything
    from skyspot.trainer.engine import deepspeed_config, initialize
    from skyspot.trainer.model import build_model, load_tokenizer

    recipe = load_recipe("tiny", [f"train.steps={args.steps}", *args.overrides])
    placement = cluster.from_environment()
    configure_threads(placement.local_world_size)
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()  # as the trainer: NCCL on a GPU, gloo on the CPU
    if accelerator.device_name() != "cpu":
        accelerator.set_device(placement.local_rank)
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), verbose=False)
    device = torch.device(accelerator.current_device_name())
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = load_tokenizer(recipe.model)
    samples = torch.from_numpy(build_samples(recipe, tokenizer))
    config = deepspeed_config(recipe)
    seed_everything(recipe.train.seed)
    model, keepalive = build_model(recipe, config, tokenizer)
    engine = initialize(recipe, model, config)

    mb, accum = recipe.train.micro_batch_size, recipe.train.grad_accum
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(recipe.train.seed))
    stamps = []
    position = 0
    for _ in range(args.steps):
        for _ in range(accum):
            take = order[(position + rank * mb + torch.arange(mb)) % len(samples)]
            position += mb * world
            ids = samples[take].to(device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            loss.item()
        stamps.append(time.time())
    if rank == 0:
        from bench._launch import emit_result

        emit_result({"step_ts": stamps})
    dist.barrier()
    del keepalive
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Estimate each zoo recipe's training time: median seconds per step x steps, at 1 and 2 threads.

Runs a few real optimizer steps of every recipe (same model, task, batch size and lengths as
``nopelens.models.zoo``) and prints the estimate next to the thread speedup. Run it on an otherwise
idle machine; on a shared one the numbers measure the contention as much as the recipe.

    python benchmarks/bench_zoo_training.py [--steps 15] [names ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from nopelens.models import Decoder, zoo
from nopelens.models.training import stream_seed


def seconds_per_step(name: str, threads: int, steps: int) -> float:
    torch.set_num_threads(threads)
    spec = zoo.recipe(name)
    task, kw = spec.make_task(), spec.train_kwargs
    model = Decoder(spec.config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=kw.get("lr", 1e-3))
    times = []
    for step in range(steps + 3):
        start = time.perf_counter()
        batch = task.sample(kw["batch_size"], kw["min_len"], kw["max_len"], stream_seed(0, 0, step))
        loss = F.cross_entropy(model(batch.tokens)[batch.loss_mask], batch.targets[batch.loss_mask])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step >= 3:  # warm-up steps excluded
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=zoo.names())
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'model':<24} {'steps':>6} {'s/step 1t':>10} {'s/step 2t':>10} {'speedup':>8} {'est. 2t total':>14}")
    for name in args.names:
        one = seconds_per_step(name, 1, args.steps)
        two = seconds_per_step(name, 2, args.steps)
        total = two * zoo.recipe(name).steps
        print(f"{name:<24} {zoo.recipe(name).steps:>6} {one:>10.4f} {two:>10.4f} {one / two:>8.2f} {total:>12.0f} s")


if __name__ == "__main__":
    main()

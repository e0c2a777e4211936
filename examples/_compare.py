"""What train_resnet.py and train_opt.py share: train the original and the converted
model on the same batches, then print losses, step time and memory side by side."""
from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

import fusedrc
from fusedrc.convert import saved_bytes


def train(model, batches, device, make_opt, loss_of):
    """(losses, step times, peak CUDA bytes or None) of one optimizer step per batch."""
    opt = make_opt(model.parameters())
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for batch in batches:
        t = time.perf_counter()
        loss = loss_of(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return losses, times, peak


def compare(original, args, batches, example, device, make_opt, loss_of, title, checked_steps=None):
    """Convert ``original``, train both, print the comparison; the exit status: 1 when the
    losses of the first ``checked_steps`` steps (all when None) differ by more than 1e-3."""
    converted = fusedrc.convert(original, policy=args.policy, memory_budget=args.budget,
                                example_inputs=example, verbose=True)
    base_bytes = saved_bytes(original, example)
    conv_bytes = saved_bytes(converted, example)
    runs = {name: train(model, batches, device, make_opt, loss_of)
            for name, model in (("original", copy.deepcopy(original)), ("fusedrc.convert", converted))}

    print(f"\n{title} on {device}, torch {torch.__version__}, backend {fusedrc.current_backend()}")
    print("step  loss (original)  loss (converted)")
    la, lb = runs["original"][0], runs["fusedrc.convert"][0]
    for i, (a, b) in enumerate(zip(la, lb)):
        print(f"{i:4d}  {a:15.6f}  {b:16.6f}")
    print(f"\n{'model':18s} {'median step (s)':>16s} {'activation bytes kept':>24s} {'peak CUDA memory':>18s}")
    for name, kept in (("original", base_bytes), ("fusedrc.convert", conv_bytes)):
        _, times, peak = runs[name]
        med = statistics.median(times[1:] if len(times) > 1 else times)
        peak_s = f"{peak / 2**20:.1f} MiB" if peak is not None else "n/a (CPU)"
        print(f"{name:18s} {med:16.3f} {kept / 2**20:18.2f} MiB {peak_s:>18s}")
    print(f"saved-bytes ratio converted/original: {conv_bytes / base_bytes:.3f}")
    pairs = list(zip(la, lb))[:checked_steps]
    if any(abs(a - b) > 1e-3 * max(abs(a), 1e-6) for a, b in pairs):
        print("losses differ" if checked_steps is None else f"losses of the first {checked_steps} steps differ",
              file=sys.stderr)
        return 1
    return 0

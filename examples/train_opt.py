"""Train a small Hugging Face OPT on synthetic tokens, original vs ``fusedrc.convert``.

Builds ``OPTForCausalLM`` from a small ``OPTConfig`` (no download), converts a copy
with ``fusedrc.convert`` (each decoder layer's FFN fc1 -> ReLU -> fc2 becomes one
fused recompute op; ``--policy blocks`` also recomputes whole decoder layers with
``fusedrc.mark``; ``--budget 0.3`` lets convert choose), and trains both from the
same weights on the same random token batches (causal LM loss). Prints each
step's loss, the median step time, the activation bytes autograd keeps per step
(saved-tensor hooks, parameters excluded) and, on CUDA, the peak memory.
Exits with status 1 if the losses differ by more than 1e-3 (relative).

Run::

    python examples/train_opt.py                    # 4 layers, d=128, seq 64, batch 4, 5 steps: CPU, < 1 min
    python examples/train_opt.py --policy blocks
    python examples/train_opt.py --device cuda --layers 12 --hidden 768 --seq 512 --batch 8
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import fusedrc  # noqa: E402
from fusedrc.convert import _import_torchvision, saved_bytes  # noqa: E402


def train(model, batches, device, lr):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for ids in batches:
        t = time.perf_counter()
        loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return losses, times, peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--activation", default="relu", help="OPT activation_function (relu, gelu, gelu_new, silu)")
    p.add_argument("--policy", default="all", choices=["all", "blocks"])
    p.add_argument("--budget", type=float, default=None, help="memory_budget for convert (fraction)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device)

    try:  # transformers imports torchvision when it is installed
        _import_torchvision()
    except ImportError:
        pass
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, word_embed_proj_dim=args.hidden,
        num_hidden_layers=args.layers, ffn_dim=4 * args.hidden, num_attention_heads=args.heads,
        max_position_embeddings=max(args.seq, 64), dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, activation_function=args.activation, use_cache=False,
    )
    torch.manual_seed(args.seed)
    original = OPTForCausalLM(cfg).to(device).train()
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
               for _ in range(args.steps)]
    example = (batches[0],)
    converted = fusedrc.convert(original, policy=args.policy, memory_budget=args.budget,
                                example_inputs=example, verbose=True)
    base_bytes = saved_bytes(original, example)
    conv_bytes = saved_bytes(converted, example)

    runs = {}
    for name, model in (("original", copy.deepcopy(original)), ("fusedrc.convert", converted)):
        runs[name] = train(model, batches, device, args.lr)

    print(f"\nOPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, "
          f"{args.steps} steps on {device}, torch {torch.__version__}, backend {fusedrc.current_backend()}")
    print("step  loss (original)  loss (converted)")
    for i, (a, b) in enumerate(zip(runs["original"][0], runs["fusedrc.convert"][0])):
        print(f"{i:4d}  {a:15.6f}  {b:16.6f}")
    print(f"\n{'model':18s} {'median step (s)':>16s} {'activation bytes kept':>24s} {'peak CUDA memory':>18s}")
    for name, kept in (("original", base_bytes), ("fusedrc.convert", conv_bytes)):
        _, times, peak = runs[name]
        med = statistics.median(times[1:] if len(times) > 1 else times)
        peak_s = f"{peak / 2**20:.1f} MiB" if peak is not None else "n/a (CPU)"
        print(f"{name:18s} {med:16.3f} {kept / 2**20:18.2f} MiB {peak_s:>18s}")
    print(f"saved-bytes ratio converted/original: {conv_bytes / base_bytes:.3f}")
    la, lb = runs["original"][0], runs["fusedrc.convert"][0]
    if any(abs(a - b) > 1e-3 * max(abs(a), 1e-6) for a, b in zip(la, lb)):
        print("losses differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

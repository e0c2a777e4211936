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
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from _compare import compare  # noqa: E402
from fusedrc.convert import import_torchvision  # noqa: E402


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
        import_torchvision()
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
    return compare(
        original, args, batches, (batches[0],), device,
        lambda params: torch.optim.AdamW(params, lr=args.lr),
        lambda model, ids: model(ids, labels=ids).loss,
        f"OPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, {args.steps} steps")


if __name__ == "__main__":
    sys.exit(main())

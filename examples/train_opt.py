"""Train a small Hugging Face causal LM on synthetic tokens, original vs ``fusedrc.convert``.

Builds ``OPTForCausalLM`` from a small ``OPTConfig`` (no download; ``--arch llama`` a
``LlamaForCausalLM``, ``--arch gpt2`` a ``GPT2LMHeadModel``, ``--arch mixtral`` a
``MixtralForCausalLM`` (8 experts of intermediate 2 * hidden, top-2) of the same size), converts a copy
with ``fusedrc.convert`` (each decoder layer's FFN fc1 -> ReLU -> fc2 becomes one
fused recompute op; Llama's gated MLP a fused gated FFN; GPT-2's MLP a fused FFN; Mixtral's
experts one fused routed-experts op;
``--policy blocks`` also recomputes whole decoder layers with
``fusedrc.mark``; ``--budget 0.3`` lets convert choose; ``--lora 16`` first wraps the model with PEFT's LoRA
adapters on every Linear, base weights frozen, as LoRA fine-tuning does: Llama's MLP is then fused with its
adapters), and trains both from the
same weights on the same random token batches (causal LM loss). Prints each
step's loss, the median step time, the activation bytes autograd keeps per step
(saved-tensor hooks, parameters excluded) and, on CUDA, the peak memory.
Exits with status 1 if the losses differ by more than 1e-3 (relative); with ``--lora-dropout`` > 0 only the
first step's are compared (the fused op draws its own dropout masks; PEFT's B starts at zero, so the first step's
adapters add nothing whatever their masks).

Run::

    python examples/train_opt.py                    # 4 layers, d=128, seq 64, batch 4, 5 steps: CPU, < 1 min
    python examples/train_opt.py --policy blocks
    python examples/train_opt.py --arch llama --budget 0.5
    python examples/train_opt.py --arch mixtral
    python examples/train_opt.py --arch llama --lora 16 --lora-dropout 0.05   # needs peft
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
    p.add_argument("--arch", default="opt", choices=["opt", "llama", "gpt2", "mixtral"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--activation", default=None,
                   help="activation function (relu, gelu, gelu_new, silu); default: the architecture's "
                        "(OPT relu, Llama and Mixtral silu, GPT-2 gelu_new)")
    p.add_argument("--policy", default="all", choices=["all", "blocks"])
    p.add_argument("--budget", type=float, default=None, help="memory_budget for convert (fraction)")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank: PEFT adapters on every Linear (0: none)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="the adapters' dropout (with --lora)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device)

    try:  # transformers imports torchvision when it is installed
        import_torchvision()
    except ImportError:
        pass
    import transformers as tr

    h, act = args.hidden, args.activation
    if args.arch == "opt":
        cfg = tr.OPTConfig(
            vocab_size=args.vocab, hidden_size=h, word_embed_proj_dim=h, num_hidden_layers=args.layers,
            ffn_dim=4 * h, num_attention_heads=args.heads, max_position_embeddings=max(args.seq, 64),
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, activation_function=act or "relu",
            use_cache=False)
        model_cls, name = tr.OPTForCausalLM, "OPT"
    elif args.arch == "llama":
        cfg = tr.LlamaConfig(
            vocab_size=args.vocab, hidden_size=h, intermediate_size=4 * h, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.heads, hidden_act=act or "silu",
            max_position_embeddings=max(args.seq, 64), use_cache=False)
        model_cls, name = tr.LlamaForCausalLM, "Llama"
    elif args.arch == "mixtral":
        cfg = tr.MixtralConfig(
            vocab_size=args.vocab, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.heads, hidden_act=act or "silu",
            num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=max(args.seq, 64), use_cache=False)
        model_cls, name = tr.MixtralForCausalLM, "Mixtral"
    else:
        cfg = tr.GPT2Config(
            vocab_size=args.vocab, n_embd=h, n_layer=args.layers, n_head=args.heads, n_positions=max(args.seq, 64),
            activation_function=act or "gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        model_cls, name = tr.GPT2LMHeadModel, "GPT-2"
    torch.manual_seed(args.seed)
    original = model_cls(cfg).to(device).train()
    if args.lora:
        import peft

        original = peft.get_peft_model(original, peft.LoraConfig(
            r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear", lora_dropout=args.lora_dropout))
        name += f" + LoRA r={args.lora}"
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
               for _ in range(args.steps)]
    return compare(
        original, args, batches, (batches[0],), device,
        lambda params: torch.optim.AdamW(params, lr=args.lr),
        lambda model, ids: model(input_ids=ids, labels=ids).loss,
        f"{name} {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, {args.steps} steps",
        checked_steps=1 if args.lora and args.lora_dropout else None)


if __name__ == "__main__":
    sys.exit(main())

"""Vocabulary-parallel head, loss and sampling across processes.

    torchrun --nproc-per-node 2 examples/vocab_parallel.py            # gloo on CPU, NCCL when CUDA is there
    torchrun --nproc-per-node 2 examples/vocab_parallel.py --vocab 262144 --width 640 --tokens 1024

Every rank builds the same full head weight from one seed and keeps only its rows (a real model would load
just its shard), computes the fused loss and its gradients on its shard, samples the next token the same way
as every other rank, and prints its loss, its shard and its peak memory. Rank 0 then checks the loss against
one process's plain computation on the full logits.
"""

from __future__ import annotations

import argparse
import resource
import sys

import torch
import torch.distributed as dist

from lmhead import SamplingConfig, VocabParallelLMHead, init_distributed


def _peak_rss_mb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary size V (default 50257)")
    p.add_argument("--width", type=int, default=256, help="model width D (default 256)")
    p.add_argument("--tokens", type=int, default=512, help="tokens N in the batch (default 512)")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout in seconds (default 60)")
    args = p.parse_args()

    rank, world = init_distributed(timeout=args.timeout)  # gloo on CPU, NCCL (+ set_device) on GPUs
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    start_rss = _peak_rss_mb()

    g = torch.Generator().manual_seed(0)  # the same data on every rank: hidden and targets are replicated
    hidden = torch.randn(args.tokens, args.width, generator=g)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    full_weight = torch.randn(args.vocab, args.width, generator=g) * args.width ** -0.5
    head = VocabParallelLMHead.from_weight(full_weight.to(device) if device else full_weight)
    if rank != 0:
        del full_weight  # only rank 0 keeps it, for the single-process check below
    hidden = hidden.to(device) if device else hidden
    targets = targets.to(device) if device else targets

    hidden.requires_grad_(True)
    loss = head.loss(hidden, targets, label_smoothing=0.1)  # fused and chunked: never [N, V_r] at once
    loss.backward()  # dW stays on this rank; dHidden is all-reduced
    ids = head.sample(hidden.detach()[:4], SamplingConfig(temperature=0.8, top_k=50, top_p=0.9, seed=1234))
    mem = (f"peak RSS {_peak_rss_mb():.0f} MB ({_peak_rss_mb() - start_rss:+.0f} MB in this script)"
           if device is None else f"peak CUDA {torch.cuda.max_memory_allocated() / 2**20:.0f} MB")
    line = (f"rank {rank}/{world}: rows [{head.vocab_start}, {head.vocab_end}) of V={args.vocab}, "
            f"loss {loss.item():.6f}, |dW_local| {head.weight.grad.norm():.4f}, sampled {ids.tolist()}, {mem}")
    for r in range(world):  # print in rank order
        if r == rank:
            print(line, flush=True)
        dist.barrier()

    if rank == 0:
        with torch.no_grad():
            logits = hidden.detach().cpu() @ full_weight.t()
            plain = torch.nn.functional.cross_entropy(logits, targets.cpu(), label_smoothing=0.1)
        diff = abs(plain.item() - loss.item())
        print(f"single process, full logits: loss {plain.item():.6f} (|difference| {diff:.1e})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

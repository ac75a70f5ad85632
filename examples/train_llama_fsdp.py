"""A Hugging Face Llama trained with its parameters and optimizer state sharded (FSDP, optionally x TP).

    python -m tpudist.xla_dist --local --nproc-per-host 2 --cpu-devices 2 -- python examples/train_llama_fsdp.py
    ... -- python examples/train_llama_fsdp.py --tp 2      # FSDP over 2 devices x tensor-parallel over 2

`transformers.LlamaForCausalLM` from a config (random weights, no download), trained by
`tpudist.compile_train_step(model, None, AdamW, mesh=..., sharding=...)`: one XLA executable per step,
compiled in the global view, with every parameter of at least 16 KiB and its AdamW moments split
over the mesh's "fsdp" axis (ZeRO-3), so each device holds about 1/N of the training state. With
`--tp M` the mesh is {"fsdp": -1, "model": M} and the attention and MLP projections are also split
Megatron-style (`tpudist.Sharding(fsdp=True, tp="llama")`).

The data is synthetic but learnable: each sequence starts at a random token and follows a fixed
random permutation of the vocabulary (token t+1 = perm[token t]), so the loss falls from about
ln(vocab) towards 0. Every process draws the same global batch from the same seeded generator
and passes its own rows of it. Each process prints its devices' memory (`step.memory()`); rank 0
prints the loss as it goes and, last, one summary line. `--checkpoint DIR` saves the sharded
training state at the end (`tpudist.checkpoint.save`, each process writing its own shards).
"""

from __future__ import annotations

import argparse

import torch

import tpudist


def make_batch(g: torch.Generator, perm: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """`rows` sequences of `length` tokens, each a walk along `perm` from a random start."""
    ids = torch.empty(rows, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, len(perm), (rows,), generator=g)
    for t in range(1, length):
        ids[:, t] = perm[ids[:, t - 1]]
    return ids


def in_units_of(nbytes: int, whole: int) -> str:
    """`nbytes` in the binary unit that suits `whole` (so both read alike: 291.8 KiB of 1154.5 KiB)."""
    unit = next(u for u in range(4) if whole < 1024 ** (u + 1) * 10 or u == 3)
    return f"{nbytes / 1024 ** unit:.1f} {('B', 'KiB', 'MiB', 'GiB')[unit]}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences per step, all processes)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads (fewer than --heads: GQA)")
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (1: FSDP only)")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--checkpoint", metavar="DIR", help="save the sharded training state here at the end")
    args = parser.parse_args(argv)

    from transformers import LlamaConfig, LlamaForCausalLM

    tpudist.init()
    rank, processes = tpudist.process_index(), tpudist.process_count()
    if args.batch % processes:
        parser.error(f"--batch {args.batch} does not split over {processes} processes")
    if args.tp > 1:
        mesh = tpudist.mesh.make_mesh({"fsdp": -1, "model": args.tp})
        sharding = tpudist.Sharding(fsdp=True, tp="llama")
    else:
        mesh = tpudist.mesh.make_mesh({"fsdp": -1})
        sharding = "fsdp"

    torch.manual_seed(0)  # the same initial weights on every process (each keeps its own shards)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    step = tpudist.compile_train_step(model, None, optimizer, mesh=mesh, sharding=sharding)

    perm = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(1))  # the rule to learn
    data = torch.Generator().manual_seed(2)  # the same global batches on every process
    local = args.batch // processes
    losses = []
    for i in range(args.steps):
        ids = make_batch(data, perm, args.batch, args.seq)[rank * local:(rank + 1) * local]
        losses.append(step({"input_ids": ids, "labels": ids}))  # the model shifts the labels itself
        if rank == 0 and (i % args.log_every == 0 or i == args.steps - 1):
            print(f"step {i:4d}  loss {losses[-1]:.4f}", flush=True)
    first, last = float(losses[0]), float(losses[-1])

    memory = step.memory()
    print(f"rank {rank}: {memory}", flush=True)
    state = step.state()
    # the whole training state's bytes, unsharded: what one device would hold without sharding=
    whole = sum(a.nbytes for a in state["params"]) + sum(a.nbytes for s in state["optimizer"] for a in s) \
        + (state["counts"].nbytes if state["counts"] is not None else 0)
    held = max(memory.parameters.get(d, 0) + memory.optimizer.get(d, 0) for d in memory.per_device)
    if args.checkpoint:
        tpudist.checkpoint.save(args.checkpoint, args.steps, state)
    if rank == 0:
        axes = ", ".join(f"{name} {size}" for name, size in mesh.shape.items())
        print(f"processes {processes}, devices {mesh.devices.size}, {axes}, loss {first:.2f} -> {last:.2f}, "
              f"params+optimizer per device {in_units_of(held, whole)} of {in_units_of(whole, whole)}", flush=True)


if __name__ == "__main__":
    main()

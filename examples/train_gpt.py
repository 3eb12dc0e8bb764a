"""Train a small GPT with osdp-fx on several processes, with checkpoints you can resume from.

What it shows:

- launching with torchrun: gloo on the CPU, NCCL on GPUs (one GPU per process);
- a real data pipeline: a ``DataLoader`` with a ``DistributedSampler`` over sequences of
  different lengths, padded per batch, the padding ignored by the loss;
- ``compile_osdp``: searching a sharding plan (the default) or using a named one
  (``--plan full_shard``, ``--plan replicate``, ``--plan plan.json``);
- AdamW over ``compiled.parameters()`` (each rank holds the optimizer state of its shards);
- gradient clipping over the whole model with ``osdp_fx.clip_grad_norm_``;
- ``save_checkpoint`` every ``--ckpt-every`` steps into ``<ckpt-dir>/step-<N>``, and
  ``--resume`` from the newest of them (or ``--resume-from <ckpt-dir>/step-<N>``), continuing
  with the same batches an uninterrupted run would have seen.

On the CPU (2 processes, a few seconds):

    torchrun --nproc_per_node 2 examples/train_gpt.py --steps 20 --ckpt-dir /tmp/gpt-ckpt
    torchrun --nproc_per_node 2 examples/train_gpt.py --steps 40 --ckpt-dir /tmp/gpt-ckpt --resume

On 8 GPUs (NCCL; parameters gathered and computed in bf16, kept and reduced in fp32):

    torchrun --nproc_per_node 8 examples/train_gpt.py --mixed-precision bf16 \
        --dim 512 --depth 8 --heads 8 --vocab 8192 --max-len 256 --batch-size 16 \
        --steps 2000 --ckpt-every 500 --ckpt-dir ckpt
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from osdp_fx import clip_grad_norm_, compile_osdp, load_checkpoint, save_checkpoint
from osdp_fx.examples import TinyGPT

PAD = 0             # token id written into the padding (any valid id: the loss ignores it)
IGNORE = -100       # label of a position the loss skips (F.cross_entropy's ignore_index)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="train until this many steps in all")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--plan", default=None,
                   help="replicate, shard_grad_op, full_shard or a plan JSON file "
                        "(default: search the fastest plan that fits the memory)")
    p.add_argument("--memory-limit", default=None, help="per rank, e.g. 8GiB (for the search)")
    p.add_argument("--mixed-precision", choices=["bf16", "fp16"], default=None)
    p.add_argument("--ckpt-dir", default="gpt-ckpt")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --ckpt-dir")
    p.add_argument("--resume-from", default=None,
                   help="continue from this checkpoint (a step-<N> directory)")
    p.add_argument("--log-every", type=int, default=5)
    # the model and the synthetic data
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-len", type=int, default=64, help="longest sequence")
    p.add_argument("--num-sequences", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def init_distributed() -> torch.device:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR in the
    environment); return this process's device."""
    # The timeout bounds every collective: a rank that dies or hangs stops the job after it.
    timeout = datetime.timedelta(minutes=5)
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)       # before the process group: one GPU per rank
        dist.init_process_group("nccl", timeout=timeout)
        return torch.device("cuda", local_rank)
    torch.set_num_threads(1)                    # several processes share the CPU cores
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


class CountingSequences(Dataset):
    """Synthetic token sequences of different lengths: each counts from a random token by a
    stride of 1 to 4 (mod vocab), so the next token is predictable once two are seen and the
    loss falls within a few dozen steps."""

    def __init__(self, num: int, vocab: int, max_len: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.sequences = []
        for _ in range(num):
            length = int(torch.randint(max_len // 4, max_len + 1, (), generator=gen))
            start = torch.randint(0, vocab, (), generator=gen)
            stride = torch.randint(1, 5, (), generator=gen)
            self.sequences.append((start + stride * torch.arange(length)) % vocab)

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.sequences[i]


def collate(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad the batch on the right to its longest sequence.

    TinyGPT has no attention mask, so pad on the right: its attention is causal, so a real token
    never sees the padding after it, and positions start at 0 in every row. The labels mark the
    padding IGNORE so that the loss averages over real tokens only."""
    longest = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), longest), PAD, dtype=torch.long)
    labels = torch.full((len(sequences), longest), IGNORE, dtype=torch.long)
    for row, s in enumerate(sequences):
        input_ids[row, :len(s)] = s
        labels[row, :len(s)] = s
    return {"input_ids": input_ids, "labels": labels}


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position t predicts token t + 1; padding is ignored.

    Each rank averages over its own real tokens, then backward averages the gradients over the
    ranks (as DDP does)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE)


def batches_from(loader: DataLoader, sampler: DistributedSampler, start_step: int):
    """Yield (step, epoch, batch) from ``start_step`` on, forever, in the order a run from step 0
    sees them: each epoch reshuffles with its own seed, and a resumed run skips the batches of
    its epoch that were trained on before the checkpoint."""
    step = start_step
    while True:
        epoch, skip = divmod(step, len(loader))
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i >= skip:
                yield step, epoch, batch
                step += 1


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar over all ranks (a collective: every rank calls it)."""
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def newest_checkpoint(ckpt_dir: str) -> str | None:
    """The ``step-<N>`` directory of ``ckpt_dir`` with the largest N (None: there is none)."""
    steps = [int(d.removeprefix("step-")) for d in (os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir)
             else []) if d.startswith("step-") and d.removeprefix("step-").isdigit()]
    return os.path.join(ckpt_dir, f"step-{max(steps)}") if steps else None


def main() -> None:
    args = parse_args()
    device = init_distributed()
    rank = dist.get_rank()

    # Data: every rank reads its own share of the sequences (DistributedSampler); drop_last
    # keeps the number of steps per epoch equal on every rank.
    dataset = CountingSequences(args.num_sequences, args.vocab, args.max_len, args.seed)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        collate_fn=collate, drop_last=True)

    # The model, built the same on every rank (compile_osdp broadcasts rank 0's values anyway).
    torch.manual_seed(args.seed)
    model = TinyGPT(vocab=args.vocab, dim=args.dim, depth=args.depth, heads=args.heads,
                    max_seq=args.max_len).to(device)

    # Compile with an example of the largest batch this run will see: the plan's memory
    # prediction is made for its shape, and the compiled module takes any smaller batch and
    # any shorter sequence.
    example = torch.randint(0, args.vocab, (args.batch_size, args.max_len), device=device)
    compiled = compile_osdp(model, (example,), plan=args.plan, memory_limit=args.memory_limit,
                            mixed_precision=args.mixed_precision)
    del model  # the compiled module holds what it needs; sharded parameters are new tensors
    if rank == 0:
        print(compiled.plan, flush=True)

    # The optimizer sees this rank's parameters: shards of the sharded ones, so its state is
    # sharded too.
    opt = torch.optim.AdamW(compiled.parameters(), lr=args.lr)

    start_step = 0
    resume_from = args.resume_from or (newest_checkpoint(args.ckpt_dir) if args.resume else None)
    if resume_from is not None:
        extra = load_checkpoint(resume_from, compiled, opt)   # collective
        start_step = extra["step"]
        if rank == 0:
            print(f"resumed from {resume_from} at step {start_step} "
                  f"(epoch {extra['epoch']})", flush=True)

    for step, epoch, batch in batches_from(loader, sampler, start_step):
        if step >= args.steps:
            break
        input_ids = batch["input_ids"].to(device)
        labels = batch["labels"].to(device)

        loss = lm_loss(compiled(input_ids), labels)
        loss.backward()               # gradients are averaged over the ranks
        norm = clip_grad_norm_(compiled, args.max_grad_norm)   # collective: the global norm
        opt.step()
        opt.zero_grad(set_to_none=True)

        if step % args.log_every == 0 or step == args.steps - 1:
            mean_loss = mean_over_ranks(loss)
            if rank == 0:
                print(f"step {step} epoch {epoch} loss {mean_loss:.6f} "
                      f"grad_norm {norm.item():.4f} seq_len {input_ids.shape[1]}", flush=True)

        done = step + 1
        if done % args.ckpt_every == 0 or done == args.steps:
            # Collective: every rank writes its own shards into one directory. "step" is the
            # number of steps done, where a resumed run starts, in epoch "epoch".
            path = os.path.join(args.ckpt_dir, f"step-{done}")
            save_checkpoint(path, compiled, opt, extra={"step": done, "epoch": done // len(loader)})
            if rank == 0:
                print(f"saved checkpoint {path} at step {done}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

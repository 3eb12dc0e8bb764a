"""Fine-tune a Hugging Face Llama with LoRA adapters (peft) under osdp-fx.

What it shows:

- a Hugging Face model compiled as its users call it: keyword inputs (``input_ids``,
  ``attention_mask``, ``labels``) given to ``compile_osdp`` through ``example_kwargs``, and the
  model's own output (``out.loss``) returned by the compiled module (Hugging Face models are
  captured by ``torch.export``);
- peft's ``get_peft_model`` freezing the base weights: frozen parameters are sharded or
  replicated as the plan says, like the adapters, and get no gradient, so only the adapters
  are reduced and updated; the script checks at the end that only adapter weights changed;
- batches of different lengths, left-padded, with the padding masked and not predicted;
- the same script in one process (no torchrun needed) or on several.

The Llama is tiny and built from a configuration with random weights, so nothing is
downloaded. For a real fine-tune, load a pretrained model with ``from_pretrained`` instead.
Needs the Hugging Face extra: ``pip install -e ".[hf]"`` (transformers, peft).

On the CPU, one process or two:

    python examples/finetune_lora.py --steps 10
    torchrun --nproc_per_node 2 examples/finetune_lora.py --steps 10

On 8 GPUs (NCCL; base weights stored in bf16, computed in bf16, adapters kept in fp32):

    torchrun --nproc_per_node 8 examples/finetune_lora.py --bf16 --steps 100
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM

from osdp_fx import compile_osdp

IGNORE = -100   # the label Hugging Face losses skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--plan", default=None, help="a strategy name or plan file (default: search)")
    p.add_argument("--bf16", action="store_true",
                   help="store the frozen base weights in bf16 and compute in bf16")
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def init_distributed() -> torch.device:
    """Join torchrun's process group when launched by torchrun; else run as one process."""
    if "RANK" not in os.environ:                  # plain `python finetune_lora.py`
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timeout = datetime.timedelta(minutes=5)
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout)
        return torch.device("cuda", local_rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def build_model(bf16: bool) -> torch.nn.Module:
    """A tiny Llama with random weights, wrapped with LoRA adapters on q_proj and v_proj."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                         max_position_embeddings=64,
                         use_cache=False)   # training: no key/value cache (it cannot be captured)
    model = LlamaForCausalLM(config)
    if bf16:
        model = model.to(torch.bfloat16)  # before get_peft_model: the adapters stay fp32
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(model, lora)    # freezes every base weight (requires_grad=False)


def token_sequences(num: int, vocab: int, max_len: int, seed: int) -> list[torch.Tensor]:
    """Synthetic "text": sequences of 4 to max_len tokens counting by 1 to 4 (mod vocab)."""
    gen = torch.Generator().manual_seed(seed)
    sequences = []
    for _ in range(num):
        length = int(torch.randint(4, max_len + 1, (), generator=gen))
        start = torch.randint(0, vocab, (), generator=gen)
        stride = torch.randint(1, 5, (), generator=gen)
        sequences.append((start + stride * torch.arange(length)) % vocab)
    return sequences


def collate(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Left-pad to the batch's longest sequence; the mask hides the padding from attention and
    the IGNORE labels keep it out of the loss (the model shifts labels itself)."""
    longest = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, s in enumerate(sequences):
        input_ids[row, longest - len(s):] = s
        attention_mask[row, longest - len(s):] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def main() -> None:
    args = parse_args()
    device = init_distributed()
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0

    texts = token_sequences(256, vocab=128, max_len=args.max_len, seed=args.seed)
    sampler = DistributedSampler(texts, seed=args.seed) if distributed else None
    loader = DataLoader(texts, batch_size=args.batch_size, sampler=sampler,
                        shuffle=sampler is None, collate_fn=collate, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed))

    torch.manual_seed(args.seed)
    model = build_model(args.bf16).to(device)
    if rank == 0:
        model.print_trainable_parameters()

    # Compile with keyword inputs, the way the model is called below. The example is a batch
    # of the longest sequences, so the plan's memory prediction covers every batch.
    example = collate([torch.arange(args.max_len)] * args.batch_size)
    example = {k: v.to(device) for k, v in example.items()}
    compiled = compile_osdp(model, (), example_kwargs=example, plan=args.plan,
                            mixed_precision="bf16" if args.bf16 else None)
    del model
    if rank == 0:
        print(compiled.plan.counts(), flush=True)

    # Only the adapters require gradients; hand the optimizer just those.
    trainable = [p for p in compiled.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr)
    before = compiled.full_state_dict()   # collective; to check what training changed

    step, epoch = 0, 0
    while step < args.steps:
        if sampler is not None:
            sampler.set_epoch(epoch)   # a new shuffle each epoch, the same on every rank
        for batch in loader:
            if step >= args.steps:
                break
            out = compiled(**{k: v.to(device) for k, v in batch.items()})
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                print(f"step {step} loss {out.loss.item():.6f} "
                      f"seq_len {batch['input_ids'].shape[1]}", flush=True)
            step += 1
        epoch += 1

    after = compiled.full_state_dict()
    changed = [name for name in after if not torch.equal(before[name], after[name])]
    if rank == 0:
        print(f"changed {len(changed)} of {len(after)} tensors; "
              f"all LoRA adapters: {all('lora_' in name for name in changed)}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""QLoRA under osdp-fx: a Hugging Face Llama loaded in 4-bit (bitsandbytes nf4), LoRA adapters
(peft) trained on it, the adapters saved in peft's format.

What it shows:

- ``from_pretrained`` with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``,
  then peft's ``get_peft_model``, compiled as they come: each 4-bit linear is captured as one
  op whose packed weight and scales are frozen parameters, sharded and gathered packed (the
  all-gathers move 4-bit bytes) as the plan says (``docs/finetuning.md``, "QLoRA");
- only the adapters are trained, reduced and updated;
- ``save_peft_adapters`` writes ``adapter_model.safetensors`` and ``adapter_config.json`` as
  peft's ``save_pretrained`` does, gathering the adapters alone; rank 0 then loads them with
  ``PeftModel.from_pretrained`` onto a 4-bit base loaded afresh and prints its loss beside the
  compiled model's.

The Llama is tiny and built from a configuration with random weights, saved to a temporary
directory and loaded back in 4-bit, so nothing is downloaded; for a real fine-tune, pass a
model name or directory with ``--model``. Needs the Hugging Face extra: ``pip install -e
".[hf]"`` (transformers, peft, bitsandbytes, safetensors).

On the CPU (bitsandbytes' 4-bit path runs there), one process or two:

    python examples/finetune_qlora.py --steps 10
    torchrun --nproc_per_node 2 examples/finetune_qlora.py --steps 10

On 8 GPUs (NCCL):

    torchrun --nproc_per_node 8 examples/finetune_qlora.py --model DIR --steps 100 --out adapters
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

from osdp_fx import compile_osdp, save_peft_adapters

VOCAB = 128


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="a Hugging Face model name or directory (default: a tiny random Llama)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--plan", default="full_shard",
                   help="a strategy name or plan file; 'search' lets osdp-fx choose")
    p.add_argument("--out", default=None, help="where the adapters go (default: a temporary dir)")
    return p.parse_args()


def init_distributed() -> torch.device:
    """Join torchrun's process group when launched by torchrun; else run as one process."""
    if "RANK" not in os.environ:
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


def tiny_llama_directory() -> str:
    """A tiny Llama with random weights (seed 0), saved as a Hugging Face checkpoint: the same
    directory on every rank (rank 0 writes it, the others wait)."""
    directory = os.path.join(tempfile.gettempdir(), "osdp_fx_tiny_llama_qlora")
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                             max_position_embeddings=64, use_cache=False)
        LlamaForCausalLM(config).save_pretrained(directory)
    if dist.is_initialized():
        dist.barrier()
    return directory


def load_4bit(source: str, device: torch.device) -> torch.nn.Module:
    """The model in 4-bit: nf4 weights, bf16 compute, as QLoRA loads it."""
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    return LlamaForCausalLM.from_pretrained(source, quantization_config=quantization,
                                            dtype=torch.bfloat16, use_cache=False,
                                            device_map={"": device})


def batch(step: int, rank: int, size: int, seq: int, vocab: int) -> torch.Tensor:
    """Synthetic "text": rows counting up by a stride from a random start (mod the vocabulary)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, vocab, (size, 1), generator=gen)
    stride = torch.randint(1, 4, (size, 1), generator=gen)
    return (start + stride * torch.arange(seq)) % vocab


def main() -> None:
    args = parse_args()
    device = init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    source = args.model or tiny_llama_directory()

    torch.manual_seed(1)
    peft_model = get_peft_model(load_4bit(source, device), LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    vocab = peft_model.config.vocab_size
    example = batch(0, rank, args.batch_size, args.seq, vocab).to(device)
    compiled = compile_osdp(peft_model, (), example_kwargs={"input_ids": example,
                                                            "labels": example},
                            plan=None if args.plan == "search" else args.plan,
                            mixed_precision="bf16")
    if rank == 0:
        print(compiled.plan.counts(), flush=True)

    opt = torch.optim.AdamW([p for p in compiled.parameters() if p.requires_grad], lr=args.lr)
    for step in range(args.steps):
        x = batch(step, rank, args.batch_size, args.seq, vocab).to(device)
        out = compiled(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step} loss {out.loss.item():.6f}", flush=True)

    out_dir = args.out or os.path.join(tempfile.gettempdir(), "osdp_fx_qlora_adapters")
    save_peft_adapters(compiled, peft_model, out_dir)   # collective; rank 0 writes

    x = batch(args.steps, 0, args.batch_size, args.seq, vocab).to(device)   # every rank alike
    compiled.eval()
    with torch.no_grad():
        compiled_loss = compiled(input_ids=x, labels=x).loss.item()
    if rank == 0:
        reloaded = PeftModel.from_pretrained(load_4bit(source, device), out_dir).eval()
        with torch.no_grad():
            reloaded_loss = reloaded(input_ids=x, labels=x).loss.item()
        print(f"adapters saved to {out_dir}: {sorted(os.listdir(out_dir))}", flush=True)
        print(f"eval loss compiled {compiled_loss:.6f} reloaded with peft {reloaded_loss:.6f}",
              flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

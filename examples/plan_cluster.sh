#!/usr/bin/env bash
# Plan a model for a GPU cluster you do not have, from this machine (a laptop is enough).
#
#     bash examples/plan_cluster.sh [PLAN.json]      (default: plan.json; about 20 s on a CPU)
#
# The model is examples/gpt_meta.py:gpt_300m, the TinyGPT of train_gpt.py at 0.3 B parameters,
# built on the meta device: nothing is allocated or run, every time comes from the preset's
# datasheet figures.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
PLAN="${1:-plan.json}"

# 1. The hardware presets osdp-fx knows, and the figures of the one we plan for: 8 x H100 SXM
#    per node, NVLink inside a node, 400 Gb/s InfiniBand per GPU between nodes.
python -m osdp_fx devices
python -m osdp_fx devices h100-sxm-8x

# 2. Search the plan for 64 GPUs (8 such nodes), computing in bf16. For every parameter it
#    chooses replicate, shard_grad_op, full_shard, hybrid_shard (sharded inside a node) or
#    hierarchical (sharded over all ranks, two-stage collectives), plus splits, recomputation
#    and the collective schedule, the fastest that fits each GPU's memory (--memory sets a
#    lower limit). It prints the plan, blocks folded, and compares it with DDP and FSDP.
#    --quiet hides the progress bar.
python -m osdp_fx plan "$HERE/gpt_meta.py:gpt_300m" \
    --devices h100-sxm-8x --world-size 64 --mixed-precision bf16 \
    --save "$PLAN" --quiet

# 3. Use the saved plan on the cluster: every rank passes the file to compile_osdp, which then
#    does not search. The file records the world size (64), the mesh (8 nodes x 8) and bf16;
#    compile_osdp refuses it at another world size.
#
#        compiled = compile_osdp(model, (input_ids,), plan="plan.json")
#
#    For example with train_gpt.py, whose model with these arguments is gpt_300m's, one
#    torchrun per node:
#
#        torchrun --nnodes 8 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
#            examples/train_gpt.py --plan plan.json --mixed-precision bf16 \
#            --vocab 50257 --dim 2048 --depth 4 --heads 16 --max-len 1024 --batch-size 4
echo "plan saved to $PLAN; train with: compile_osdp(model, inputs, plan=\"$PLAN\")"

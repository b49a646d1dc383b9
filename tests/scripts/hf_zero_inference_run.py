"""HF's "Non-Trainer DeepSpeed integration" ZeRO-Inference example, run by torchrun, with
one line added first (``import trainer.deepspeed``):

    torchrun --nproc-per-node 2 tests/scripts/hf_zero_inference_run.py MODEL_DIR OUT_DIR

As HF's guide writes it: its config (ZeRO-3, parameters offloaded to the CPU, no
optimizer and no ``offload_optimizer``, ``stage3_prefetch_bucket_size`` a fraction of
``0.9 * hidden_size**2``), ``HfDeepSpeedConfig`` kept alive before ``from_pretrained``
(which then builds the model under ``deepspeed.zero.Init``),
``deepspeed.initialize(model=model, config_params=ds_config)[0]``,
``ds_engine.module.eval()`` and ``ds_engine.module.generate(..., synced_gpus=True)``. Each
rank asks for a different number of new tokens (``synced_gpus`` keeps the rank that is done
in the gathers) and writes its tokens to ``OUT_DIR/rank<r>.json``. Its inputs go to
``ds_engine.device`` where the guide writes ``device=local_rank`` (a CUDA index).
"""

import trainer.deepspeed  # noqa: F401, I001  - the one line a DeepSpeed script adds

import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

local_rank = int(os.getenv("LOCAL_RANK", "0"))
world_size = int(os.getenv("WORLD_SIZE", "1"))
deepspeed.init_distributed()
model_name, out = sys.argv[1], Path(sys.argv[2])
config = AutoConfig.from_pretrained(model_name)
model_hidden_size = config.n_embd
train_batch_size = 1 * world_size
ds_config = {
    "fp16": {"enabled": False},
    "bf16": {"enabled": False},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": model_hidden_size * model_hidden_size,
        "stage3_prefetch_bucket_size": 0.9 * model_hidden_size * model_hidden_size,
        "stage3_param_persistence_threshold": 10 * model_hidden_size,
    },
    "steps_per_print": 2000,
    "train_batch_size": train_batch_size,
    "train_micro_batch_size_per_gpu": 1,
    "wall_clock_breakdown": False,
}
dschf = HfDeepSpeedConfig(ds_config)  # keep this object alive
model = AutoModelForCausalLM.from_pretrained(model_name)
ds_engine = deepspeed.initialize(model=model, config_params=ds_config)[0]
ds_engine.module.eval()
rank = torch.distributed.get_rank()
prompt = [[5, 7, 11, 13], [17, 19, 23]][rank]
inputs = torch.tensor([prompt]).to(ds_engine.device)
with torch.no_grad():
    outputs = ds_engine.module.generate(inputs, synced_gpus=True, do_sample=False,
                                        max_new_tokens=4 + 3 * rank)
(out / f"rank{rank}.json").write_text(json.dumps({
    "prompt": prompt, "tokens": outputs.cpu().tolist(),
    "trainable_units": [unit.trainable for unit in ds_engine.engine.units],
    "padded_numel": sum(unit.padded_numel for unit in ds_engine.engine.units),
    "shard_nbytes": ds_engine.engine.offload_stats()["shard_nbytes"]}))
torch.distributed.barrier()
torch.distributed.destroy_process_group()

"""An Accelerate script with no DeepSpeed in its code: ``accelerate launch`` of a DeepSpeed
config makes it one (``python -m trainer.hf launch --config_file CFG.yaml`` here).

    python -m trainer.hf launch --config_file cfg.yaml accelerate_launch_run.py --out DIR

``Accelerator()`` takes the DeepSpeed plugin from the launcher's environment (the
config file the yaml names). A torch AdamW, a model of two linear layers, a loader of
fixed batches; rank 0 writes ``DIR/result.json``: its loss per step, what accelerate
decided (distributed type, processes, the ZeRO stage) and the engine's class.
"""

import trainer.hf  # noqa: F401, I001  - the line an Accelerate script adds

import argparse
import json
from pathlib import Path

import torch
from _leave import leave_group
from accelerate import Accelerator, PartialState

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

if not torch.cuda.is_available():
    PartialState(cpu=True)  # on a host without CUDA, accelerate's group needs gloo first
accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
generator = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=generator),
                                      torch.randint(0, 3, (32,), generator=generator))
loader = torch.utils.data.DataLoader(data, batch_size=4)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses = []
for features, labels in loader:
    loss = torch.nn.functional.cross_entropy(model(features.to(accelerator.device)),
                                             labels.to(accelerator.device))
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
if accelerator.is_main_process:
    Path(args.out, "result.json").write_text(json.dumps({
        "losses": losses, "distributed_type": str(accelerator.distributed_type),
        "num_processes": accelerator.num_processes,
        "stage": accelerator.state.deepspeed_plugin.zero_stage,
        "engine": type(model).__module__ + "." + type(model).__name__}))
leave_group()

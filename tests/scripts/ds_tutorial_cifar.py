"""DeepSpeed's CIFAR-10 tutorial (DeepSpeedExamples ``training/cifar``) as its users run it:
the same calls in the same order, and no line for offloadd. DeepSpeed's launcher runs it,
``python -m trainer.deepspeed`` here (offloadd's facade is ``deepspeed`` in every rank):

    python -m trainer.deepspeed --num_gpus 2 tests/scripts/ds_tutorial_cifar.py \
        --stage 3 --dtype fp32 --out DIR

What differs from the tutorial, for a test: synthetic images instead of the download
(64 to train, 16 to test), a seeded model, and ``--out``: rank 0 writes ``DIR/losses.json``
(rank 0's loss at each step) and the engine saves a checkpoint in ``DIR/ckpt`` at the end.
The tutorial's own code is untouched: ``deepspeed.add_config_arguments``,
``deepspeed.init_distributed()``, ``deepspeed.initialize(args=, model=,
model_parameters=, training_data=, config=)`` returning its data loader,
``get_accelerator().device_name(model_engine.local_rank)``,
``model_engine.bfloat16_enabled()``/``fp16_enabled()`` for the input dtype, the config as
the tutorial writes it (``"Adam"``, ``WarmupLR``, ``"cpu_offload": false``, the fp16
loss-scale knobs), and its ``--local_rank`` argument, which the launcher passes.
"""

import argparse
import json
from pathlib import Path

import deepspeed
import torch
from _cifar_net import Net, datasets  # the tutorial's model; its data, made up
from deepspeed.accelerator import get_accelerator
from torch import nn


def add_argument() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--dtype", default="fp16", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_ds_config(args: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999],
                                                 "eps": 1e-8, "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False,
                 "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                 "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True,
                              "reduce_scatter": True, "allgather_bucket_size": 50000000,
                              "reduce_bucket_size": 50000000, "overlap_comm": True,
                              "contiguous_gradients": True, "cpu_offload": False},
    }


def main(args: argparse.Namespace) -> None:
    deepspeed.init_distributed()
    trainset, testset = datasets()
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    ds_config = get_ds_config(args)
    model_engine, _optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset,
        config=ds_config)
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _epoch in range(args.epochs):
        for data in trainloader:
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    testloader = torch.utils.data.DataLoader(testset, batch_size=4, shuffle=False)
    correct = total = 0
    with torch.no_grad():
        for images, labels in testloader:
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(local_device)).sum().item()
    print(f"Accuracy of the network on the {total} test images: {100 * correct / total:.0f} %")
    out = Path(args.out)
    model_engine.save_checkpoint(str(out / "ckpt"))
    if local_rank == 0:
        (out / "losses.json").write_text(json.dumps({"losses": losses, "correct": correct}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(add_argument())

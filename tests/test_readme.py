"""Every Python block of README.md runs as written (issue 19, item 4).

A block leaves some names to the reader (``model``, ``loader``, ``config``,
``rank``, ...): ``PRELUDES`` defines them, small, for each block, keyed by the
block's first line. The deployment paths a block names (the node daemon's
socket, an NVMe mount) are pointed at a private daemon and a temp dir; nothing
else in the block's text changes; ``/models/llama`` is a tiny Llama saved with
``save_pretrained``. A new README block without a prelude fails here, so it has to
be made runnable to be added. The integration sections show only the lines that change
(```py fragments): their whole scripts are examples/, run by tests/test_examples.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

README = Path(__file__).resolve().parent.parent / "README.md"
NODE_SOCKET = "/run/offloadd/offloadd.sock"
NVME_MOUNT = "/nvme0/offloadd"
MODEL_DIR = "/models/llama"

_GPT2 = """
import torch, transformers
gpt2_config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97,
                                      n_positions=16)
"""

PRELUDES = {
    "import trainer": _GPT2 + """
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(gpt2_config)
ids = torch.randint(0, 97, (4, 16))
loader = [{"input_ids": ids, "labels": ids}] * 2
_forward = model.forward
model.forward = lambda batch: _forward(**batch).loss  # the loop calls engine(batch)
""",
    "decay = [p for n, p in model.named_parameters() if p.ndim >= 2]": _GPT2 + """
import trainer
model = transformers.GPT2LMHeadModel(gpt2_config)
config = {"train_micro_batch_size_per_gpu": 2}
""",
    "from trainer.zero.estimate import ModelCounts, estimate": _GPT2 + """
model = transformers.GPT2LMHeadModel(gpt2_config)
""",
    "with trainer.zero.Init(config_dict_or_path=config):": _GPT2 + """
import trainer
config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
rank = 0
""",
    "import transformers, trainer": """
import os
offload = {"device": "nvme", "nvme_path": os.path.abspath("nvme")}  # in the test's tmp_path
config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}},
          "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "offload_param": offload,
                                "offload_optimizer": offload}}
resume = False
""",
    "for step, batch in enumerate(loader, start=engine.global_steps):": _GPT2 + """
import trainer
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(gpt2_config)
engine, *_ = trainer.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2})
ids = torch.randint(0, 97, (2, 16))
loader = [{"input_ids": ids, "labels": ids}] * 2
""",
    "from trainer.client import OffloadClient": """
import torch
tensor = torch.arange(16, dtype=torch.float32)
""",
}


def python_blocks(text: str) -> list[str]:
    """The README's ```python blocks (indented ones too), dedented."""
    blocks = []
    for match in re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M):
        indent = len(match.group(1))
        blocks.append("".join(line[indent:] + "\n" for line in match.group(2).splitlines()))
    return blocks


def first_line(block: str) -> str:
    """The block's first line without its comment (the block's key in ``PRELUDES``)."""
    return block.strip().splitlines()[0].split("#")[0].strip()


def test_every_block_has_a_prelude() -> None:
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 4
    assert {first_line(block) for block in blocks} == set(PRELUDES)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the README calls /models/llama: a tiny Llama as ``save_pretrained`` writes it."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=97,
                                      max_position_embeddings=32)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def node_daemon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The node's daemon; module-scoped, so made before the test's own temp dir: its work
    dir is its own (removed at stop) and its swap dir pytest's."""
    from offloadd.ops.embedded import PrivateDaemon

    daemon = PrivateDaemon.start(arena_size=64 << 20,
                                 swap_dirs=[str(tmp_path_factory.mktemp("swap"))])
    yield daemon
    daemon.stop()


@pytest.mark.parametrize("block", python_blocks(README.read_text()), ids=first_line)
def test_block_runs_as_written(block: str, node_daemon: Any, llama_dir: Path, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = block.replace(NODE_SOCKET, node_daemon.socket_path)
    code = code.replace(NVME_MOUNT, str(tmp_path / "nvme"))
    code = code.replace(MODEL_DIR, str(llama_dir))
    namespace: dict[str, Any] = {"__name__": "readme"}
    exec(compile(PRELUDES[first_line(block)], "prelude", "exec"), namespace)
    engine = None
    try:
        exec(compile(code, f"README.md: {first_line(block)}", "exec"), namespace)
        engine = namespace.get("engine")
    finally:
        if engine is None and "engine" in namespace:
            engine = namespace["engine"]
        if engine is not None:
            engine.close()
        client = namespace.get("client")
        if client is not None and not client.closed:
            client.close()

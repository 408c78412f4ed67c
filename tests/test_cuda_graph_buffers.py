"""The decode-graph path's static buffers and padding, checked on the CPU.

A CUDA graph replays the forward it captured over ``DecodeGraphs``' static
buffers. Here the "graph" is that same forward run eagerly over the same
buffers (``_launch``), and the layers take their kernel-shaped decode path
with the kernel wrappers' torch references (which honour the padding
contract: state slot -1, slot_mapping -1, seq_len 0). Greedy tokens must match
the plain runner's, with batches padded up to the captured sizes.
"""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.worker.cuda_graph import DecodeGraphs, capture_sizes
from tests import checkpoints

PROMPTS = [[3, 4, 5], [5, 6, 7, 8, 9, 10] * 4, list(range(20, 45)), [7] * 8, list(range(60, 71)), [11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class EagerDecodeGraphs(DecodeGraphs):
    """Runs the captured forward eagerly over the static buffers instead of replaying a graph."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.launched: list[int] = []

    def _launch(self, size: int) -> torch.Tensor:
        self.launched.append(size)
        return self._forward(size)


@pytest.fixture
def kernel_shaped_layers(monkeypatch):
    """The layers' GPU decode path on the CPU: the kernel wrappers fall back to their references."""
    from atom.layers import kda, moe
    from atom.ops import cuda as kernels

    for module in (kda, moe, kernels):
        monkeypatch.setattr(module, "kernels_apply", lambda *tensors: True)


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_capture_sizes():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 4)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert capture_sizes(1000) == (1, 2, 4, 8, 16, 32, 64, 128)  # the MoE's dense-path bound


def test_cpu_never_captures(kimi_ckpt):
    assert LLM(kimi_ckpt, max_num_seqs=2).engine.runner.decode_graphs is None


@pytest.mark.parametrize("variant", ["kda_mla", "mla_first_qlora"])
def test_static_buffer_forward_matches_eager(tmp_path, kernel_shaped_layers, variant):
    path = checkpoints.make_kimi_checkpoint(str(tmp_path), variant, tokenizer=False)
    kwargs = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 16}
    eager = _generate(LLM(path, **kwargs))
    llm = LLM(path, **kwargs)
    runner = llm.engine.runner
    graphs = EagerDecodeGraphs(llm.config, runner.model, runner.caches, runner.device)
    runner.decode_graphs = graphs
    assert _generate(llm) == eager
    assert graphs.launched and max(graphs.launched) == 4
    assert llm.engine.all_resources_free()

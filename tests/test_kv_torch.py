"""KV blocks as torch tensors: CPU always; CUDA (device-to-host through pinned staging) where a GPU is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.kv.agent import KvAgent
from shared.kv.buffers import as_block
from shared.kv.filestore import FileStore
from tests.kvkit import LAYOUT

CUDA = torch.cuda.is_available()


def agent(store: FileStore, pod: str) -> KvAgent:
    return KvAgent(store, pod=pod, node="n", namespace="llm", deployment="llama", layout=LAYOUT)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
async def test_torch_cpu_blocks_save_and_restore_in_place(tmp_path: Path, dtype: torch.dtype) -> None:
    store = FileStore(tmp_path)
    gen = torch.Generator().manual_seed(5)
    elements = LAYOUT.block_bytes // torch.tensor([], dtype=dtype).element_size()
    blocks = [torch.randn(elements, generator=gen).to(dtype).reshape(2, -1) for _ in range(3)]
    saver = agent(store, "p1")
    saver.register_session("s")
    for b in blocks:
        saver.append_block("s", b)
    assert not (await saver.save()).failed
    pool = [torch.zeros_like(b) for b in blocks]
    await agent(store, "p2").restore("s", into=pool)
    assert all(torch.equal(a, b) for a, b in zip(pool, blocks, strict=True))


def test_non_contiguous_tensors_are_refused_with_the_reason() -> None:
    with pytest.raises(TypeError, match="not contiguous"):
        as_block(torch.zeros(8, 8).t())


@pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU; run on the lent GPU machine (python -m bench.checkpoint --device cuda)"
)
async def test_cuda_blocks_go_through_pinned_staging_and_come_back(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    blocks = [torch.randint(0, 255, (LAYOUT.block_bytes,), dtype=torch.uint8, device="cuda") for _ in range(4)]
    saver = agent(store, "p1")
    saver.register_session("s")
    for b in blocks:
        saver.append_block("s", b)
    assert not (await saver.save()).failed
    pool = [torch.zeros_like(b) for b in blocks]
    await agent(store, "p2").restore("s", into=pool)
    assert all(torch.equal(a, b) for a, b in zip(pool, blocks, strict=True))

"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch.distributed as dist

from dist_helpers import free_port


@pytest.fixture
def isolated_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In-process fits init a process group and set rank variables; undo both afterwards."""
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for key in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        os.environ.pop(key, None)

"""Joining the process group: a MASTER_PORT another process holds is one line naming the port
and what to do (exit 2), not torch's DistNetworkError traceback."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from harness.distributed import init_distributed
from harness.errors import ConfigError


def test_a_master_port_in_use_is_one_line_naming_it(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(key, value)
        with pytest.raises(ConfigError) as err:
            init_distributed("cpu", 30.0, force_group=True)  # a group of one, as DeepSpeed's engines ask for
    message = str(err.value)
    assert "\n" not in message and f"MASTER_PORT={port} is already in use" in message and "unset MASTER_PORT" in message, message
    assert not dist.is_initialized()

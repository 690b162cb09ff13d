"""Making a NIXL agent that behaves on this machine, and its descriptor tables.

Pitfalls handled here (measured by the team on a CPU-only machine, 2026): the python wrapper sets
the progress thread's delay to 0, so every agent busy-spins a core; NIXL logs
INFO lines to stdout; UCX advertises every network device unless told otherwise.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from kv_transfer.base import KVLayout, TransferError, TransportConfig

_agent_lock = threading.Lock()  # guards the config-class swap in new_agent


def import_nixl() -> Any:
    """NIXL's python API module. tandem depends on `nixl-cu13` alone (the CUDA 13 build
    that torch 2.13's CUDA wheels match; on a CPU machine its UCX backend works the
    same), not on the `nixl` meta package, which installs the CUDA 12 build too (about
    220 MB more). An install that has the meta package (or only nixl-cu12) still works."""
    import importlib

    for name in ("nixl_cu13._api", "nixl._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not name.startswith(e.name or "\0"):  # a module missing inside NIXL itself
                raise
    raise ModuleNotFoundError("NIXL is not installed (tandem's gpu extra has it, or pip install nixl-cu13)",
                              name="nixl_cu13")


def set_env_defaults(config: TransportConfig) -> None:
    """Native settings read when the UCX context is made: keep NIXL's INFO lines
    off stdout and, for a loopback cluster, let UCX advertise loopback only."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if config.bind_host.startswith("127.") or config.bind_host == "localhost":
        os.environ.setdefault("UCX_NET_DEVICES", "lo")


def new_agent(api: Any, name: str, delay_us: int) -> Any:
    """Create an agent whose progress thread sleeps `delay_us` between polls.

    `nixl_agent.__init__` builds its pybind `nixlAgentConfig` itself and sets
    `pthrDelay = 0`, which busy-spins a core per agent (NIXL.md pitfall 1). We
    swap in a config subclass that clamps the delay for the duration of the
    constructor, under a lock so concurrent creations see a consistent module.
    """
    bindings = api.nixlBind
    base_cls = bindings.nixlAgentConfig
    delay_prop = base_cls.pthrDelay

    class _Config(base_cls):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return delay_prop.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            delay_prop.__set__(self, max(int(value), delay_us))

    with _agent_lock:
        bindings.nixlAgentConfig = _Config
        try:
            agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        finally:
            bindings.nixlAgentConfig = base_cls
    if "UCX" not in agent.backends:
        raise TransferError(
            f"NIXL agent {name} has no UCX backend (plugins: {agent.get_plugin_list()})"
        )
    return agent


def region_indices(layout: KVLayout, blocks: np.ndarray, layers: range) -> np.ndarray:
    """Descriptor indices, ordered (layer, k|v, block), of `blocks` over `layers`."""
    rows = np.arange(layers.start, layers.stop)[:, None] * 2 + np.arange(2)[None, :]
    idx = rows[:, :, None] * layout.num_blocks + blocks[None, None, :]
    return idx.reshape(-1).astype(np.int32)


def region_table(layout: KVLayout, base_addr: int, device_id: int) -> np.ndarray:
    """Nx3 (addr, len, device) of every region of a KV tensor, in index order."""
    n = layout.num_layers * 2 * layout.num_blocks
    table = np.empty((n, 3), dtype=np.uint64)
    table[:, 0] = base_addr + np.arange(n, dtype=np.uint64) * np.uint64(layout.region_bytes)
    table[:, 1] = layout.region_bytes
    table[:, 2] = device_id
    return table

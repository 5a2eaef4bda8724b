"""Servers of a GPU test module, each started on first use and one at a time.

A ``-k`` selection starts only the servers its tests read (each spends a minute or more
starting and compiling). One at a time, each after the previous one answers /health: SGLang
sizes a server's KV pool as the GPU's free memory after its weights load minus
(1 - mem_fraction_static) of the free memory before they loaded, so a neighbour allocating its
pool in between leaves it none ("Loaded weights leave no GPU memory for the KV cache"; on the
H200 with three of five started at once, and on a warm machine with two, 2026-12-04).
"""

from __future__ import annotations

from pathlib import Path

from conftest import start_server, stop_server

START_TIMEOUT_S = 540
"""FlashInfer builds its kernels for SmolLM2's shapes (head_dim 64, 9 query / 3 KV heads) with
nvcc on first use: the devkit's prebuilt JIT cache holds the 8B shapes only. On the H200 the
vanilla server's decode-graph capture took 102 s and its first request over 45 s with five
servers compiling at once, past the CPU suite's 240 s start limit."""


class LazyServers:
    """``servers.NAME``: the server of ``specs[NAME]`` (its flags after ``--model-path`` and
    ``common``), started on first read. Every test reading a server runs on the attention
    backend ``backends[NAME]`` (checked when it starts, so a ``-k`` selection checks the servers
    it starts and no others) and, with ``cuda_graphs``, with SGLang's CUDA graphs on."""

    def __init__(self, model_dir: Path, logs: Path, common: list[str],
                 specs: dict[str, list[str]], backends: dict[str, str],
                 cuda_graphs: bool = False) -> None:
        self._model_dir, self._logs, self._up = model_dir, logs, {}
        self._common, self._specs, self._backends = common, specs, backends
        self._cuda_graphs = cuda_graphs

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in self._specs:
            raise AttributeError(name)
        if name not in self._up:
            args = ["--model-path", str(self._model_dir), *self._common, *self._specs[name]]
            srv = start_server(args, self._logs / f"{name}.log", timeout_s=START_TIMEOUT_S)
            self._up[name] = srv
            info = srv.get("/get_server_info").json()
            assert info["attention_backend"] == self._backends[name], \
                (name, info["attention_backend"])
            if self._cuda_graphs:
                assert not info["disable_cuda_graph"], name
        return self._up[name]

    def stop(self) -> None:
        for srv in self._up.values():
            stop_server(srv)

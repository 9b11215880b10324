"""All-reduce bus bandwidth on this node: NCCL across its GPUs, gloo across two CPU processes (part of doctor --deep).

How to use::

    result = allreduce_bandwidth(torch.device("cuda"))   # or cpu; sizes_mb=, repeats=
    result["rows"]      # [{"size_mb", "median_ms", "algbw_gbps", "busbw_gbps"}], or result["why"]

Bus bandwidth as nccl-tests defines it, so the numbers compare with theirs: algbw = bytes / time and
busbw = algbw x 2(n-1)/n for an all-reduce over n ranks (what each link carries, independent of n). Each rank is a
fresh spawned process (no CUDA context or OpenMP pool inherited); ranks meet on a loopback TCP store. Times are the
median over repeats after one warm-up, measured on rank 0 between barriers (CPU) or with CUDA events (GPU).
A node with one GPU has no NCCL peer: the result says so rather than measuring a loopback that means nothing.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

SIZES_MB = (1, 16, 64)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, backend: str, port: int, sizes_mb: Sequence[int], repeats: int, out: str) -> None:
    import torch.distributed as dist

    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # gloo's own threads do the reduction; an OpenMP pool per rank only contends
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        rows = []
        for size_mb in sizes_mb:
            tensor = torch.ones(size_mb * 2 ** 20 // 4, dtype=torch.float32, device=device)
            dist.all_reduce(tensor)  # warm-up: connection set-up and buffer registration are not bandwidth
            times = []
            for _ in range(repeats):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    dist.all_reduce(tensor)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                else:
                    dist.barrier()
                    begin = time.perf_counter()
                    dist.all_reduce(tensor)
                    times.append(time.perf_counter() - begin)
            seconds = statistics.median(times)
            algbw = tensor.numel() * 4 / seconds / 1e9
            rows.append({"size_mb": size_mb, "median_ms": seconds * 1e3, "algbw_gbps": algbw,
                         "busbw_gbps": algbw * 2 * (world - 1) / world})
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def allreduce_bandwidth(device: torch.device, sizes_mb: Sequence[int] = SIZES_MB, repeats: int = 5) -> dict[str, Any]:
    if device.type == "cuda":
        world = torch.cuda.device_count()
        if world < 2:
            return {"backend": "nccl", "ranks": world, "rows": [],
                    "why": f"{world} GPU on this node: NCCL all-reduce needs at least two"}
        backend = "nccl"
    else:
        backend, world = "gloo", 2
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ablate-comm-") as tmp:
        out = os.path.join(tmp, "rows.json")
        try:
            mp.spawn(_rank, args=(world, backend, _free_port(), tuple(sizes_mb), repeats, out), nprocs=world,
                     join=True)
            rows = json.loads(Path(out).read_text())
        except Exception as exc:  # noqa: BLE001 - a collective that cannot run is the finding, not a crash
            return {"backend": backend, "ranks": world, "rows": [], "why": f"{type(exc).__name__}: {exc}"[:500]}
    return {"backend": backend, "ranks": world, "rows": rows, "why": "",
            "criterion": f"median of {repeats} all-reduces after one warm-up, fp32, "
                         f"{'CUDA events' if backend == 'nccl' else 'perf_counter between barriers'}"}

"""A later rank of a forked multi-worker arm waits for rank 0's TCPStore before it joins (``trainers.worker``):
the wait ends when the store listens, the bare connections it makes leave the store serving, and a group whose
rank 0 arrives late still forms. What it saves is measured in ``benchmarks/bench_store_join.py``."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from trainers.worker import _join_group, wait_for_store


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_wait_ends_once_a_late_store_listens_and_the_store_then_serves_its_clients() -> None:
    port = _free_port()
    up: dict[str, Any] = {}

    def start_late() -> None:
        time.sleep(0.3)
        up["at"] = time.monotonic()
        up["store"] = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
        up["store"].set("ready", "yes")

    master = threading.Thread(target=start_late)
    master.start()
    assert wait_for_store("127.0.0.1", port, 30.0) is True
    returned = time.monotonic()
    master.join()
    assert returned >= up["at"]  # not before the store existed
    for _ in range(3):  # more bare connections, as several later ranks make
        assert wait_for_store("127.0.0.1", port, 5.0) is True
    client = dist.TCPStore("127.0.0.1", port, 2, False)
    assert client.get("ready") == b"yes"
    client.set("from_client", "1")
    assert up["store"].get("from_client") == b"1"


def test_the_wait_gives_up_after_its_timeout_when_nothing_listens() -> None:
    port = _free_port()  # closed again: nothing listens there
    start = time.monotonic()
    assert wait_for_store("127.0.0.1", port, 0.2) is False
    assert time.monotonic() - start >= 0.2


def _rank(rank: int, port: int, delay: float, out: Any, group: str = "arm-a", value: float = 0.0,
          timeout_s: float = 60) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    time.sleep(delay)
    try:
        _join_group({"context": {"rank": rank, "world_size": 2}, "backend": "gloo", "group": group,
                     "timeout_s": timeout_s})
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((group, rank, type(exc).__name__))
        return
    total = torch.tensor([value or float(rank + 1)])
    dist.all_reduce(total)
    out.put((group, rank, float(total.item())))
    dist.destroy_process_group()


def test_a_group_forms_when_rank_one_asks_before_rank_zero_listens() -> None:
    ctx = mp.get_context("fork")  # as the fork server's children: torch imported before the fork
    out = ctx.Queue()
    port = _free_port()
    ranks = [ctx.Process(target=_rank, args=(0, port, 0.5, out)), ctx.Process(target=_rank, args=(1, port, 0.0, out))]
    for proc in ranks:
        proc.start()
    got = {rank: value for _, rank, value in (out.get(timeout=60) for _ in ranks)}
    for proc in ranks:
        proc.join(timeout=30)
    assert got == {0: 3.0, 1: 3.0}
    assert [proc.exitcode for proc in ranks] == [0, 0]


def test_a_rank_that_reaches_another_arms_store_stays_out_of_that_arms_group() -> None:
    """The port rank 0 picked is free, not reserved: here arm B's rank 0 holds it, and arm A's rank 1 reaches
    B's store. B's group must form of B's two ranks alone (their sum, 1 + 2; A's rank would add 100), and A's rank
    must fail its join rather than wait in, or take a place in, B's rendezvous."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = _free_port()
    ranks = [ctx.Process(target=_rank, args=(1, port, 0.0, out, "arm-a", 100.0, 5)),
             ctx.Process(target=_rank, args=(0, port, 0.2, out, "arm-b", 1.0)),
             ctx.Process(target=_rank, args=(1, port, 0.6, out, "arm-b", 2.0))]
    for proc in ranks:
        proc.start()
    got = {(group, rank): value for group, rank, value in (out.get(timeout=90) for _ in ranks)}
    for proc in ranks:
        proc.join(timeout=30)
    assert got[("arm-b", 0)] == got[("arm-b", 1)] == 3.0
    assert isinstance(got[("arm-a", 1)], str)  # the name of the error its join raised: it never joined

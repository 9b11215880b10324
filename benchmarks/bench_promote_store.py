"""Benchmark: ``ablate promote`` over 10,000 receipts read back from MLflow, end to end through the CLI.

Targets: <= 10 s from the local SQLite store, <= 20 s from a loopback ``mlflow server`` (SQLite backend,
artifacts served by the server), on this 2-core machine.

How to run me (from the repository root)::

    python benchmarks/bench_promote_store.py                  # 3 interleaved CLI runs per store kind
    python benchmarks/bench_promote_store.py --repeat 5 --profile --previous
    python benchmarks/bench_promote_store.py --call-sites --repeat 3   # with receipt bundles (see below)

The store (benchmarks/store_10k.py) is populated once through the product's write path and cached under
/tmp/ablate-bench-10k/; population time is recorded there (``populated.json``), not timed here. The server is
started by this script on a free loopback port and stopped at the end. Every run appends one record to
benchmarks/results/promote_store.json (never overwritten): date, git commit, threads, host load, per-run
seconds, medians, targets met or missed.

``--cache`` (default ``all``) says what each CLI run remembers of receipts already checked
(``ablate.receipts.accepted``): ``cold`` runs start from an empty cache, so every receipt is checked in full (the
first promotion over a store on a machine that did not log it); ``sweep`` runs start from a copy of the cache the
store's writers left (``store_10k.WRITER_CACHE``: the first promotion after a sweep, on the machine whose driver
logged it); ``warm`` runs share one primed by an untimed run (every later promotion over the same receipts). All are
timed, interleaved, and reported apart. ``sweep`` needs a store populated by writers that remember (and the same
checking code since): otherwise it is left out, and the record says why.

``--profile`` adds in-process timings of the read path's parts (run search, payload decode + validation,
per-artifact reads sequential and concurrent, the promotion rule). ``--previous`` times the CLI of the last
commit (``git archive HEAD``: one ``receipt.json`` download per receipt) on a one-lane subset of the store
(~1,300 receipts; the other runs marked deleted in a copy of the database) next to this tree's CLI on the same
subset, and extrapolates the previous path to the full store.

``--page-cache cold`` drops the kernel's page cache before every CLI run (root only): the store and the installed
packages are read from disk, as in a promotion hours after the store was written. ``--against REV`` times the CLI
of commit REV in every round too, interleaved with this tree's (keys ``<store>/<cache>@<short hash>``; which tree
goes first alternates by round, so give an even ``--repeat``), and records this tree's median over REV's per key.
Its ``sweep`` runs copy the cache this tree's checking code matches: a REV with other checking code checks every
receipt there (a cold run by another name). The MLflow server of the ``server`` runs is started once: ``cold``
empties the kernel's cache, not the server's own.

``--call-sites`` times the CLI of a copy of this tree with the two proposed call sites of
``ablate.tracking.receipt_bundle`` applied (``_patched_tree``: the reader in ``load_receipts_from_mlflow``; the
writer is what ``store_10k.add_bundles`` ran once on the cached store), since this worktree does not edit
``mlflow_store.py``. Each record says which tree ran (``variant``). The host is shared with other engineers'
jobs: every run records the load average before and after it; compare medians only at similar load.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "tests")]

import store_10k  # noqa: E402
from records import compile_tree  # noqa: E402
from sweeps_common import start_mlflow_server, stop_mlflow_server  # noqa: E402

from ablate.parallel import usable_processes  # noqa: E402
from ablate.receipts.accepted import CACHE_ENV, OFF  # noqa: E402
from ablate.tracking.bulk_read import DOWNLOAD_THREADS  # noqa: E402
from trainers.provenance import git_state  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "promote_store.json"
TARGETS_S = {"sqlite": 10.0, "server": 20.0}
ABLATE = Path(sys.executable).parent / "ablate"
SUBSET_LANE = "L0-"
QUIET_FLAG = Path("/tmp/cpu-quiet")
DROP_CACHES = "/proc/sys/vm/drop_caches"


@contextlib.contextmanager
def quiet_window(enabled: bool) -> Iterator[None]:
    """Hold the shared host's /tmp/cpu-quiet flag (the other tenants pause heavy work) for one timed part; waits
    while someone else holds it. Kept short: one round of CLI runs, one profile."""
    if not enabled:
        yield
        return
    while QUIET_FLAG.exists():
        time.sleep(5)
    QUIET_FLAG.touch()
    try:
        yield
    finally:
        QUIET_FLAG.unlink(missing_ok=True)


def _drop_page_cache() -> None:
    """Written pages first (``sync``), then the clean ones dropped: the next run reads what it needs from disk."""
    os.sync()
    Path(DROP_CACHES).write_text("3\n")


def _git_commit() -> str:
    sha, dirty = git_state(REPO)
    return (sha or "unknown") + ("+dirty" if dirty else "")


def _host() -> dict[str, Any]:
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "cpu_count": os.cpu_count(),
            "threads": threading.active_count(), "cpu_quiet_flag": Path("/tmp/cpu-quiet").exists(),
            # The CLI's numpy runs on the BLAS/OpenMP pools these set (unset: one thread per core).
            "thread_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                          "MKL_NUM_THREADS")}}


READ_LINE = "_read_receipts(client, sweep_id, uri, receipts, rejected, links, use_payload, ui_url, run_labels)"
IMPORT_LINE = "from ablate.tracking.bulk_read import collector_paused, read_arm_runs\n"


def _patched_tree(tmp: Path) -> Path:
    """This working tree's packages with the proposed reader call site applied to ``mlflow_store.py``."""
    tree = tmp / "call-sites"
    for name in ("ablate", "kernels", "trainers", "search_spaces"):
        shutil.copytree(REPO / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    store = tree / "ablate" / "tracking" / "mlflow_store.py"
    text = store.read_text()
    if text.count(READ_LINE) != 1 or IMPORT_LINE not in text:
        raise RuntimeError(f"{store}: the call site to patch is not where this benchmark expects it")
    head, _, tail = text.partition("    " * 3 + READ_LINE)
    text = head + "    " * 3 + "receipt_bundle." + READ_LINE.removeprefix("_") + tail
    text = text.replace(IMPORT_LINE, IMPORT_LINE + "from ablate.tracking import receipt_bundle\n", 1)
    store.write_text(text)
    return tree


def time_cli(uri: str, out_dir: Path, pythonpath: Optional[Path] = None,
             cache_dir: Optional[Path] = None) -> dict[str, Any]:
    """One ``ablate promote`` process, wall clock from spawn to exit. ``cache_dir``: where it remembers accepted
    receipt payloads (``ablate.receipts.accepted``); default: none at all (every receipt checked in full)."""
    env = {**os.environ, "COLUMNS": "200", CACHE_ENV: str(cache_dir) if cache_dir is not None else OFF}
    command = [str(ABLATE), "promote", "--tracking-uri", uri, "--out", str(out_dir)]
    if pythonpath is not None:  # another checkout of the package, same interpreter and dependencies
        env["PYTHONPATH"] = str(pythonpath)
        command = [sys.executable, "-m", "ablate", "promote", "--tracking-uri", uri, "--out", str(out_dir)]
    load = [round(x, 2) for x in os.getloadavg()]
    start = time.perf_counter()
    # cwd: the checkout's root, where the default policy and defaults (search_spaces/) are looked up.
    done = subprocess.run(command, cwd=pythonpath or REPO, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"promote failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads(max(out_dir.glob("*.json"), key=lambda p: p.stat().st_mtime).read_text())
    verdicts: dict[str, int] = {}
    for verdict in report.get("verdicts", []):
        verdicts[verdict.get("verdict", "?")] = verdicts.get(verdict.get("verdict", "?"), 0) + 1
    return {"seconds": round(seconds, 2), "receipts": report["num_receipts"],
            "rejected": len(report["rejected_receipts"]), "loadavg_before": load,
            "loadavg_after": [round(x, 2) for x in os.getloadavg()], "verdicts": verdicts,
            "report_id": report.get("report_id")}


def _profile(uri: str) -> dict[str, float]:
    """Seconds per part of the read path, in process (imports excluded)."""
    from ablate.promote import promote
    from ablate.tracking import bulk_read
    from ablate.tracking.mlflow_store import TrackingClient

    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    parts: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        value = fn()
        parts[name] = round(time.perf_counter() - start, 2)
        return value

    client = TrackingClient(uri, store_10k.EXPERIMENT)
    runs = timed("search_runs_all_pages", lambda: [r for _, r in sorted(client.arm_runs().items())])
    with bulk_read.collector_paused():  # as load_receipts_from_mlflow reads
        outcomes = timed("payload_decode_validate", lambda: bulk_read.read_arm_runs(runs, uri))
    receipts = [o.receipt for o in outcomes if o.receipt is not None]
    sample = runs[:500]

    def previous_style() -> None:  # the last commit's reader: get_run + download, one run after the other
        with tempfile.TemporaryDirectory() as tmp:
            for run in sample:
                path = client.client.download_artifacts(run.info.run_id, "receipt.json", dst_path=tmp)
                bulk_read.parse_receipt(Path(path).read_text())

    timed("artifact_reads_500_previous_style", previous_style)
    for threads in (1, 8):
        timed(f"artifact_reads_500_threads{threads}",
              lambda: bulk_read.read_arm_runs(sample, uri, use_payload=False, threads=threads))
    for key in [k for k in parts if k.startswith("artifact_reads_500")]:
        parts[key.replace("_500_", "_per_10k_")] = round(parts[key] * len(runs) / len(sample), 1)
    gc.freeze()  # as the CLI does before the rule
    timed("promote_rule_and_report", lambda: promote(receipts, policy_path=REPO / "search_spaces" / "policies" /
                                                     "default.yaml", defaults_path=REPO / "search_spaces" /
                                                     "defaults.yaml").to_json())
    gc.unfreeze()
    parts["runs"] = len(runs)
    return parts


def _subset_db(directory: Path, source: str) -> Path:
    """A copy of ``source`` (a database of the store) keeping the arm runs of one lane; the rest marked deleted
    (search_runs skips deleted runs; their artifacts stay where they are)."""
    target = directory / f"subset-{Path(source).name}"
    if target.exists():
        return target
    tmp = target.with_suffix(".tmp")
    shutil.copyfile(source, tmp)
    with sqlite3.connect(tmp) as db:
        db.execute("UPDATE runs SET lifecycle_stage = 'deleted' WHERE run_uuid IN (SELECT run_uuid FROM tags WHERE "
                   "key = 'ablate.receipt_id' AND value NOT LIKE ?)", (SUBSET_LANE + "%",))
    tmp.rename(target)
    return target


def _writer_check_ms(sample: int = 500, repeats: int = 3) -> dict[str, Any]:
    """CPU milliseconds the writer spends per logged payload checking it as a reader would
    (``bulk_read.logged_payload_key``, what ``TrackingClient.log_arm`` adds to each arm), in this process."""
    from bench_promote import build

    from ablate.receipts.store import seal
    from ablate.tracking.bulk_read import logged_payload_key
    from ablate.tracking.mapping import receipt_tags
    from ablate.tracking.payload import encode_json

    items = []
    for receipt in build(sample)[:sample]:
        sealed = seal(receipt)
        payload = sealed.model_dump_json().encode("utf-8")
        items.append((payload, {**receipt_tags(sealed), **encode_json(payload)}))
    runs = []
    for _ in range(repeats):
        start = time.process_time()
        keys = [logged_payload_key(payload, tags) for payload, tags in items]
        runs.append(round((time.process_time() - start) / len(items) * 1000, 3))
        if not all(keys):
            raise RuntimeError("the writer refused a payload of the benchmark's own campaign")
    return {"median_ms": statistics.median(runs), "runs_ms": runs, "payloads": len(items),
            "criterion": f"median of {repeats} passes over the same payloads, CPU time (process_time) per payload"}


def _writers_cache(directory: Path) -> tuple[Optional[Path], str]:
    """(the cache the store's writers left, what it is), or (None, why not) when it is missing or was written by
    other checking code than this tree's: the CLI would then check every receipt, a cold run by another name."""
    from ablate.tracking.bulk_read import CHECKING_FINGERPRINT

    cache = directory / store_10k.WRITER_CACHE
    current = cache / f"accepted-{CHECKING_FINGERPRINT}.bin"
    if not cache.is_dir():
        return None, f"{directory} was populated before its writers remembered what they logged"
    if not current.exists():
        return None, (f"{cache} holds no file of this tree's checking code ({current.name}; it has "
                      f"{sorted(p.name for p in cache.glob('accepted-*.bin'))}): populate the store again")
    from ablate.receipts import accepted

    keys = len(accepted._read(current)[0])
    receipts = json.loads((directory / store_10k.MARKER).read_text())["receipts"]
    # A population retry ("database is locked") finds its run logged and remembers nothing: those are checked.
    return cache, f"{current}: {keys} keys for {receipts} receipts"


def _previous_tree(tmp: Path, revision: str = "HEAD", name: str = "previous") -> Path:
    tree = tmp / name
    tree.mkdir()
    archive = subprocess.run(["git", "archive", revision, "ablate", "kernels", "trainers", "search_spaces"], cwd=REPO,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receipts", type=int, default=10_368)
    parser.add_argument("--repeat", type=int, default=3, help="CLI runs per store kind (0: only --profile/--previous)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--previous", action="store_true")
    parser.add_argument("--note", default="")
    parser.add_argument("--quiet", action="store_true", help="hold /tmp/cpu-quiet during each timed part")
    parser.add_argument("--pause", type=float, default=60.0, help="seconds between rounds (not timed)")
    parser.add_argument("--store", type=Path, default=None,
                        help="an already populated store directory (e.g. one written under an older receipt schema "
                             "version, which readers still accept) instead of the one for this schema version")
    parser.add_argument("--cache", choices=("cold", "sweep", "warm", "both", "all"), default="all",
                        help="cold: every CLI run starts with no remembered receipt (each one checked in full); sweep: "
                             "each starts from a copy of what the store's writers remembered (the first promotion "
                             "after a sweep); warm: runs share a cache primed by one untimed run (a promotion over "
                             "receipts already read once); both: cold and warm; all: the three, interleaved")
    parser.add_argument("--page-cache", choices=("warm", "cold"), default="warm",
                        help="cold: the kernel's page cache is dropped before every CLI run (root only), so the "
                             "store's pages and the installed packages are read from disk, as in a promotion hours "
                             "after the store was written; warm: as the previous runs left it")
    parser.add_argument("--against", default=None, metavar="REV",
                        help="also time the CLI of commit REV (git archive) in every round, interleaved with this "
                             "tree's runs: its keys end in @REV")
    parser.add_argument("--call-sites", action="store_true",
                        help="time a copy of this tree with the receipt-bundle call sites applied")
    args = parser.parse_args()
    if args.page_cache == "cold" and not os.access(DROP_CACHES, os.W_OK):
        raise SystemExit(f"--page-cache cold: {DROP_CACHES} is not writable here (root only); allowed: --page-cache "
                         f"warm")
    os.environ[CACHE_ENV] = OFF  # the in-process parts (--profile) check every receipt; CLI runs choose per run

    directory = args.store or store_10k.populate(args.receipts)
    if not (directory / store_10k.MARKER).exists():
        raise SystemExit(f"{directory}: not a populated store (no {store_10k.MARKER})")
    bundles = store_10k.add_bundles(directory) if args.call_sites else None
    populated = json.loads((directory / store_10k.MARKER).read_text())
    server_db = store_10k.server_backend(directory)
    uris = {"sqlite": store_10k.sqlite_uri(directory)}
    record: dict[str, Any] = {"benchmark": "promote_store", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "git_commit": _git_commit(), "store": str(directory), "population": populated,
                              "host_start": _host(), "note": args.note, "targets_s": TARGETS_S,
                              "download_threads": DOWNLOAD_THREADS, "bundles": bundles,
                              "variant": "this tree + proposed receipt-bundle call sites" if args.call_sites
                              else "this tree", "criterion": f"median of {args.repeat} CLI runs per store kind, "
                                                             f"interleaved", "cpu_count": os.cpu_count(),
                              # The CLI splits checking, analysis and plots over this many processes (ablate.parallel).
                              "cli_processes": usable_processes(), "page_cache": args.page_cache}
    with tempfile.TemporaryDirectory(prefix="ablate-bench-store-") as tmp_name:
        tmp = Path(tmp_name)
        server, uris["server"] = start_mlflow_server(server_db, directory / "mlartifacts", tmp / "server.log")
        tree = _patched_tree(tmp) if args.call_sites else None
        trees: dict[str, Optional[Path]] = {"": tree}
        if args.against:
            record["against"] = subprocess.run(["git", "rev-parse", args.against], cwd=REPO, capture_output=True,
                                               text=True, check=True).stdout.strip()
            # The label names run directories too: the short hash, never a ref with a slash in it.
            trees[f"@{record['against'][:7]}"] = _previous_tree(tmp, record["against"], "against")
        record["bytecode"] = {label or "this tree": compile_tree(path or REPO) for label, path in trees.items()}
        try:
            states = {"both": ("cold", "warm"), "all": ("cold", "sweep", "warm")}.get(args.cache, (args.cache,))
            sweep_cache, record["sweep_cache"] = _writers_cache(directory)
            if "sweep" in states and sweep_cache is None:
                print(f"  no 'sweep' runs: {record['sweep_cache']}", flush=True)
                states = tuple(state for state in states if state != "sweep")
            warm_cache = tmp / "cache-warm"
            if "warm" in states and args.repeat:
                (tmp / "priming").mkdir()
                record["warm_priming"] = time_cli(uris["sqlite"], tmp / "priming", pythonpath=tree,
                                                  cache_dir=warm_cache)
                print(f"  priming the warm cache (untimed in the medians): {record['warm_priming']['seconds']:.2f} s",
                      flush=True)
            for label in [label for label in trees if label and "warm" in states and args.repeat]:
                (tmp / f"priming{label}").mkdir()  # REV's own warm cache: its checking code remembers apart
                time_cli(uris["sqlite"], tmp / f"priming{label}", pythonpath=trees[label],
                         cache_dir=tmp / f"cache-warm{label}")
            runs: dict[str, list[dict[str, Any]]] = {f"{kind}/{state}{label}": [] for kind in uris
                                                     for state in states for label in trees}
            for i in range(args.repeat):  # interleaved: drift on a shared host hits every variant alike
                if i:
                    time.sleep(args.pause)  # the other tenants' turn between quiet windows
                with quiet_window(args.quiet):
                    # Each round starts the order one state later: the run after a cold one (its forked
                    # children exiting, the page cache it filled) is not always the same state's.
                    order = states[i % len(states):] + states[:i % len(states)]
                    labels = list(trees) if i % 2 == 0 else list(trees)[::-1]
                    for kind, uri, state, label in [(k, u, st, lb) for k, u in uris.items() for st in order
                                                    for lb in labels]:
                        key = f"{kind}/{state}{label}"
                        out = tmp / f"{kind}-{state}-{i}{label}"
                        out.mkdir()
                        cache = tmp / f"cache-{state}-{kind}-{i}{label}"
                        if state == "warm":  # one per tree, primed before the rounds
                            cache = tmp / f"cache-warm{label}" if label else warm_cache
                        if state == "sweep":  # each run its own copy: a run adds what it checked in full
                            shutil.copytree(sweep_cache, cache)
                        if args.page_cache == "cold":
                            _drop_page_cache()
                        runs[key].append({**time_cli(uri, out, pythonpath=trees[label], cache_dir=cache),
                                          "cache": state, "threads": threading.active_count()})
                        print(f"  {key:20s} run {i + 1}: {runs[key][-1]['seconds']:.2f} s "
                              f"({runs[key][-1]['receipts']} receipts, load {runs[key][-1]['loadavg_before']})",
                              flush=True)
            if args.repeat:
                record["runs"] = runs
                record["medians_s"] = {key: _median([r["seconds"] for r in rs]) for key, rs in runs.items()}
                record["targets_met"] = {key: record["medians_s"][key] <= TARGETS_S[key.split("/")[0]]
                                         for key in runs}
                if args.against:  # this tree's median over REV's, per store and cache state
                    record["ratio_to_against"] = {
                        key: round(record["medians_s"][key] / record["medians_s"][f"{key}@{record['against'][:7]}"], 3)
                        for key in runs if "@" not in key}
            record["writer_check_ms"] = _writer_check_ms()
            print(f"  writer's check per logged payload: {record['writer_check_ms']['median_ms']} ms of CPU",
                  flush=True)
            if args.profile:
                record["profile"] = {}
                for kind, uri in uris.items():
                    with quiet_window(args.quiet):
                        record["profile"][kind] = _profile(uri)
            if args.previous:
                with quiet_window(args.quiet):
                    record["previous"] = previous = _previous(directory, server_db, tmp, uris)
                for kind in uris:
                    rows = previous[kind]
                    # Linear in the receipt count: search, one download and one validation per receipt.
                    rows["extrapolated_full_s"] = round(rows["previous_commit"]["seconds"] * args.receipts /
                                                        rows["previous_commit"]["receipts"], 1)
        finally:
            stop_mlflow_server(server)
    record["host_end"] = _host()
    history = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(history + [record], indent=2) + "\n")  # kept before printing: no run is lost
    _print(record)
    print(f"appended to {RESULTS.relative_to(REPO)} ({len(history) + 1} records)")


def _previous(directory: Path, server_db: Path, tmp: Path, uris: dict[str, str]) -> dict[str, Any]:
    """This tree's CLI and the last commit's on a one-lane subset of the same store, each store kind."""
    tree = _previous_tree(tmp)
    sqlite_subset = _subset_db(directory, str(directory / "mlflow.db"))
    server_subset = _subset_db(directory, str(server_db))
    server, url = start_mlflow_server(server_subset, directory / "mlartifacts", tmp / "server-subset.log")
    out: dict[str, Any] = {"subset": f"arm runs of lane {SUBSET_LANE}*"}
    try:
        for kind, uri in (("sqlite", f"sqlite:///{sqlite_subset}"), ("server", url)):
            rows = {}
            for label, path in (("this_tree", None), ("previous_commit", tree)):
                target = tmp / f"prev-{kind}-{label}"
                target.mkdir()
                rows[label] = time_cli(uri, target, pythonpath=path)
                print(f"  subset {kind:6s} {label:15s}: {rows[label]['seconds']:.2f} s "
                      f"({rows[label]['receipts']} receipts)", flush=True)
            out[kind] = rows
    finally:
        stop_mlflow_server(server)
    return out


def _print(record: dict[str, Any]) -> None:
    receipts = record["population"]["receipts"]
    print(f"\nablate promote via the CLI, {receipts} receipts, commit {record['git_commit'][:12]}, host load "
          f"{record['host_start']['loadavg']} -> {record['host_end']['loadavg']}, {record['host_start']['cpu_count']} "
          f"CPUs, {record['host_start']['threads']} thread(s) in the benchmark")
    print(f"page cache: {record.get('page_cache', 'warm')}" + (f"; against {record['against'][:12]}"
                                                                  if record.get("against") else ""))
    print(f"{'store/cache':22s} {'runs (s)':32s} {'median':>8s} {'target':>8s}  met")
    for key, rows in record.get("runs", {}).items():
        times = ", ".join(f"{r['seconds']:.2f}" for r in rows)
        print(f"{key:22s} {times:32s} {record['medians_s'][key]:8.2f} {TARGETS_S[key.split('/')[0]]:8.1f}  "
              f"{'yes' if record['targets_met'][key] else 'NO'}")
    for key, ratio in record.get("ratio_to_against", {}).items():
        print(f"{key}: this tree / {record['against'][:12]} = {ratio:.3f} (medians)")
    for kind, parts in record.get("profile", {}).items():
        print(f"profile {kind}: " + ", ".join(f"{k}={v}" for k, v in parts.items()))
    previous = record.get("previous")
    if previous:
        for kind in ("sqlite", "server"):
            rows = previous[kind]
            print(f"subset ({rows['this_tree']['receipts']} receipts) {kind}: this tree "
                  f"{rows['this_tree']['seconds']:.2f} s, previous commit {rows['previous_commit']['seconds']:.2f} s; "
                  f"previous path extrapolated to the full store: {rows['extrapolated_full_s']:.1f} s")


if __name__ == "__main__":
    main()

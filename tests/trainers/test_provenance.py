"""Provenance that lets a receipt reproduce its run and keeps evidence from different code or machines apart:
git dirtiness, file content hashes, and the code, hardware and software fingerprints.

Git tests use real repositories in tmp_path; the hardware records have the shape ``observe_hardware`` returns
(NVML on CUDA machines; this CI machine has no GPU, so the CUDA record is written out by hand).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from trainers import provenance
from trainers.provenance import (
    code_fingerprint,
    file_sha256,
    git_state,
    hardware_fingerprint,
    observe_hardware,
    software_fingerprint,
    software_versions,
)

REPO = Path(__file__).resolve().parents[2]
_GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.invalid", "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_CONFIG_NOSYSTEM": "1"}


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, env={**os.environ, **_GIT_ENV})


def _repo(root: Path, files: dict[str, str]) -> Path:
    """A committed repository holding ``files``."""
    root.mkdir(parents=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "init")
    return root


# --- git_state and file_sha256 ---


def test_an_untracked_campaign_file_makes_the_tree_dirty_an_ignored_file_does_not(tmp_path: Path) -> None:
    root = _repo(tmp_path / "r", {"README.md": "x\n", ".gitignore": "*.log\nablate_runs/\n"})
    sha, dirty = git_state(root)
    assert sha is not None and len(sha) == 40 and dirty is False
    (root / "run.log").write_text("ignored\n")
    (root / "ablate_runs").mkdir()
    (root / "ablate_runs" / "r.json").write_text("{}")
    assert git_state(root) == (sha, False), ".gitignore'd output is not a change to the code"
    # Before the fix: --untracked-files=no, so a run from a campaign file never committed said git_dirty: false.
    (root / "my_campaign.yaml").write_text("features: {moe_dispatch: [jagged]}\n")
    assert git_state(root) == (sha, True)
    (root / "my_campaign.yaml").unlink()
    (root / "README.md").write_text("edited\n")
    assert git_state(root) == (sha, True)


def test_file_sha256_is_the_content_hash_of_the_file_as_used(tmp_path: Path) -> None:
    path = tmp_path / "campaign.yaml"
    path.write_bytes(b"features: {moe_dispatch: [jagged]}\n")
    first = file_sha256(path)
    assert first == hashlib.sha256(path.read_bytes()).hexdigest() and len(first) == 64
    path.write_bytes(b"features: {moe_dispatch: [jagged]}  \n")  # whitespace is a different file as used
    assert file_sha256(path) != first
    with pytest.raises(FileNotFoundError):
        file_sha256(tmp_path / "missing.yaml")


# --- code_fingerprint ---


def test_code_fingerprint_follows_the_working_tree_of_kernels_and_trainers(tmp_path: Path) -> None:
    root = _repo(tmp_path / "r", {
        "kernels/__init__.py": "", "kernels/moe.py": "def dispatch():\n    return 1\n",
        "trainers/loop.py": "STEPS = 4\n", "ablate/cli.py": "x = 1\n", "README.md": "docs\n",
        ".gitignore": "__pycache__/\n*_gen.py\n"})
    clean = code_fingerprint(root)
    assert len(clean) == 16 and code_fingerprint(root) == clean

    (root / "kernels" / "moe.py").write_text("def dispatch():\n    return 2\n")  # uncommitted kernel edit
    edited = code_fingerprint(root)
    assert edited != clean, "a dirty kernel is different code"
    _git(root, "commit", "-qam", "edit")
    assert code_fingerprint(root) == edited, "content decides, not HEAD: committing the same bytes changes nothing"
    (root / "kernels" / "moe.py").write_text("def dispatch():\n    return 1\n")
    assert code_fingerprint(root) == clean

    # Outside kernels/ and trainers/, build caches, ignored files and untracked non-Python files do not count.
    (root / "README.md").write_text("more docs\n")
    (root / "ablate" / "cli.py").write_text("x = 2\n")
    (root / "kernels" / "__pycache__").mkdir()
    (root / "kernels" / "__pycache__" / "moe.cpython-311.pyc").write_bytes(b"\x00\x01")
    (root / "kernels" / "scan_gen.py").write_text("GENERATED = 1\n")
    (root / "trainers" / "notes.txt").write_text("todo\n")
    assert code_fingerprint(root) == clean

    # An untracked module next to the others would be imported: it counts. So does a deleted tracked file.
    (root / "trainers" / "extra.py").write_text("import kernels\n")
    assert code_fingerprint(root) not in (clean, edited)
    (root / "trainers" / "extra.py").unlink()
    assert code_fingerprint(root) == clean
    (root / "trainers" / "loop.py").unlink()
    assert code_fingerprint(root) != clean
    _git(root, "checkout", "--", "trainers/loop.py")

    # A working dir without .git (what `ray job submit --working-dir` ships) gives the same fingerprint.
    shutil.copytree(root, tmp_path / "shipped", ignore=shutil.ignore_patterns(".git", "__pycache__", "*_gen.py",
                                                                              "notes.txt"))
    assert code_fingerprint(tmp_path / "shipped") == clean
    (tmp_path / "shipped" / "kernels" / "moe.py").write_text("def dispatch():\n    return 3\n")
    assert code_fingerprint(tmp_path / "shipped") != clean


def test_code_fingerprint_of_this_repository_is_cheap_and_refuses_a_wrong_root(tmp_path: Path) -> None:
    # It runs once per arm in the orchestrator; measured at ~5 ms here (2 git ls-files + ~250 KB read).
    code_fingerprint(REPO)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        code_fingerprint(REPO)
        times.append(time.perf_counter() - start)
    assert statistics.median(times) < 0.5, f"code_fingerprint took {statistics.median(times):.3f} s"
    with pytest.raises(ValueError, match="kernels"):
        code_fingerprint(tmp_path)


# --- hardware_fingerprint ---

_CUDA_STACK = {"torch.cuda": "12.8", "cudnn": "91002", "nccl": "2.27.3", "torch": "2.13.0"}


def _gpu(index: int, name: str = "NVIDIA H100 80GB HBM3") -> dict[str, Any]:
    return {"index": index, "name": name, "uuid": f"GPU-0000-{index}", "memory_total_bytes": 85520809984,
            "memory_used_bytes": 1 << 30, "sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "mem_clock_mhz": 2619,
            "power_w": 312.5, "power_limit_w": 700.0, "temperature_c": 41, "throttle_reasons_mask": 0,
            "throttle_reasons": []}


def _cuda_record(num_gpus: int = 1, **changes: Any) -> dict[str, Any]:
    """The record observe_hardware("cuda") returns from NVML."""
    record = {"kind": "cuda", "source": "nvml", "count": 8, "gpus": [_gpu(i) for i in range(num_gpus)],
              "driver": "570.124.06", "cuda_driver": 12080, "visible_count": num_gpus,
              "cpu": {"kind": "cpu", "cpu_model": "Intel(R) Xeon(R) Platinum 8480+", "logical_cpus": 224,
                      "cpus_in_affinity": 224, "torch_threads": 8, "machine": "x86_64"}}
    record.update(changes)
    return record


@pytest.mark.parametrize("field", ["sm_clock_mhz", "max_sm_clock_mhz", "mem_clock_mhz", "temperature_c", "power_w",
                                   "memory_used_bytes", "throttle_reasons_mask", "uuid", "index"])
def test_readings_of_the_moment_do_not_change_the_hardware_fingerprint(field: str) -> None:
    base = hardware_fingerprint(_cuda_record(), _CUDA_STACK)
    moved = _cuda_record()
    moved["gpus"][0][field] = 1 if field != "uuid" else "GPU-other-card"
    assert hardware_fingerprint(moved, _CUDA_STACK) == base


def test_what_decides_speed_changes_the_hardware_fingerprint() -> None:
    base = hardware_fingerprint(_cuda_record(), _CUDA_STACK)
    other_model = _cuda_record()
    other_model["gpus"][0]["name"] = "NVIDIA A100-SXM4-80GB"
    capped = _cuda_record()
    capped["gpus"][0]["power_limit_w"] = 400.0
    variants = {
        "gpu model": hardware_fingerprint(other_model, _CUDA_STACK),
        "gpu count": hardware_fingerprint(_cuda_record(num_gpus=2), _CUDA_STACK),
        "gpus on the node": hardware_fingerprint(_cuda_record(count=4), _CUDA_STACK),
        "power cap": hardware_fingerprint(capped, _CUDA_STACK),
        "driver": hardware_fingerprint(_cuda_record(driver="580.65.06"), _CUDA_STACK),
        "cuda driver": hardware_fingerprint(_cuda_record(cuda_driver=13000), _CUDA_STACK),
        "cpu model": hardware_fingerprint(_cuda_record(cpu={**_cuda_record()["cpu"], "cpu_model": "AMD EPYC 9654"}),
                                          _CUDA_STACK),
        "cudnn": hardware_fingerprint(_cuda_record(), {**_CUDA_STACK, "cudnn": "90100"}),
        "nccl": hardware_fingerprint(_cuda_record(), {**_CUDA_STACK, "nccl": "2.21.5"}),
        "torch cuda": hardware_fingerprint(_cuda_record(), {**_CUDA_STACK, "torch.cuda": "13.0"}),
    }
    assert base not in variants.values() and len(set(variants.values())) == len(variants), variants
    # Only the CUDA stack of the software record counts here (torch itself is software_fingerprint's).
    assert hardware_fingerprint(_cuda_record(), {**_CUDA_STACK, "torch": "2.14.0"}) == base


def test_hardware_fingerprint_tolerates_missing_and_malformed_fields() -> None:
    partial = copy.deepcopy(_cuda_record())
    del partial["gpus"][0]["name"], partial["driver"], partial["cpu"]
    records: list[Any] = [None, {}, {"gpus": None}, {"gpus": [None, "GPU-0"]}, {"cpu": "x86"}, partial,
                          {"kind": "cuda", "source": "torch", "count": None, "visible_count": 1,
                           "gpus": [{"index": 0, "name": "NVIDIA H100", "memory_total_bytes": 1}], "driver": None}]
    prints = [hardware_fingerprint(record, {}) for record in records]
    assert all(len(p) == 16 for p in prints)
    assert hardware_fingerprint(partial, {}) != hardware_fingerprint(_cuda_record(), {})


def test_cpu_records_fingerprint_the_cpu_threads_and_host_allocator_actually_used() -> None:
    observed = observe_hardware("cpu")
    base = hardware_fingerprint(observed, {})
    assert hardware_fingerprint(observe_hardware("cpu"), {}) == base
    assert hardware_fingerprint({**observed, "torch_threads": (observed["torch_threads"] or 0) + 1}, {}) != base
    assert hardware_fingerprint({**observed, "cpu_model": "another cpu"}, {}) != base
    other = "retain" if observed["host_allocator"] == "system" else "system"
    assert hardware_fingerprint({**observed, "host_allocator": other}, {}) != base


# --- software_fingerprint ---


def test_cuda_library_wheels_are_recorded_and_every_version_changes_the_fingerprint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuBLAS/cuDNN/NCCL pip wheels are upgraded independently of torch and decide GEMM and collective speed.
    A real dist-info directory on sys.path is what pip leaves behind; importlib.metadata finds it the same way."""
    dist = tmp_path / "nvidia_cublas_cu12-12.8.4.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-cublas-cu12\nVersion: 12.8.4.1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    versions = software_versions()
    assert versions["nvidia-cublas-cu12"] == "12.8.4.1"
    assert {"python", "torch", "triton", "torch.cuda", "torch.git", "cudnn", "nccl"} <= set(versions)
    base = software_fingerprint(versions)
    for key in versions:
        changed = {**versions, key: f"{versions[key]}-other"}
        assert software_fingerprint(changed) != base, f"{key} is left out of the software fingerprint"


def test_a_fork_servers_versions_stand_until_something_is_installed(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked arm takes the versions its server read (here a marked copy, to see which one is reported) while
    the distributions on its import path are those the server saw, and reads them again once one was installed."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(provenance, "_READ_BY_PARENT", None)
    provenance.read_installed_versions_for_children()
    stamp, read = provenance._READ_BY_PARENT
    monkeypatch.setattr(provenance, "_READ_BY_PARENT", (stamp, {**read, "torch": "as the server read it"}))
    assert software_versions()["torch"] == "as the server read it"
    dist = tmp_path / "nvidia_late_cu99-9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-late-cu99\nVersion: 9.9\n")
    versions = software_versions()
    assert versions["nvidia-late-cu99"] == "9.9" and versions["torch"] == read["torch"]


def test_code_fingerprint_covers_the_ablate_modules_an_arm_runs(tmp_path: Path) -> None:
    # A preset pattern, a feature's backend or the env an arm inherits decide what runs: an edit there is new code.
    files = {"kernels/__init__.py": "", "trainers/loop.py": "STEPS = 4\n", "ablate/cli.py": "x = 1\n",
             "ablate/config/pattern.py": "PRESETS = {'nam56r': 'AEMEAEMEAEMR*4'}\n",
             "ablate/config/backends.py": "CPU = 'compiled'\n", "ablate/receipts/derive.py": "WARM = 2\n",
             "ablate/redact.py": "PASS = ('OMP_*',)\n", "ablate/sweep/node_check.py": "OK = 1\n",
             "ablate/sweep/run.py": "driver = 1\n", "ablate/promote/rule.py": "rule = 1\n"}
    for use_git in (True, False):
        root = _repo(tmp_path / f"git{use_git}", files) if use_git else tmp_path / "plain"
        if not use_git:  # a ``ray job submit`` working dir: no .git, every *.py of the packages
            for name, text in files.items():
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_text(text)
        clean = code_fingerprint(root)
        for name in ("ablate/config/pattern.py", "ablate/config/backends.py", "ablate/receipts/derive.py",
                     "ablate/redact.py", "ablate/sweep/node_check.py"):
            (root / name).write_text(files[name] + "# edited\n")
            assert code_fingerprint(root) != clean, f"{name} runs in the arm (git: {use_git})"
            (root / name).write_text(files[name])
        for name in ("ablate/cli.py", "ablate/sweep/run.py", "ablate/promote/rule.py"):  # the driver's and reader's
            (root / name).write_text(files[name] + "# edited\n")
            assert code_fingerprint(root) == clean, f"{name} never runs in an arm (git: {use_git})"


def test_a_pair_pinned_to_its_slot_keeps_the_nodes_cpu_fingerprint() -> None:
    # Whether an interleaved block gets a pinned CPU slot depends on what else holds the node's CPUs at that moment;
    # the fingerprint must not see it, or one sweep's blocks split into two "hardware" fingerprints and the older
    # half is superseded (its failures with it: seen under a loaded host). Run in a child: it narrows its affinity.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import json, os
        from trainers import pairing
        from trainers.provenance import _cpu_facts, hardware_fingerprint
        free = _cpu_facts()
        pairing.pin({sorted(os.sched_getaffinity(0))[0]})
        pinned = _cpu_facts()
        print(json.dumps([free, pinned, hardware_fingerprint(free) == hardware_fingerprint(pinned)]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    free, pinned, same = json.loads(out.stdout.strip().splitlines()[-1])
    assert pinned["cpus_in_affinity"] == free["cpus_in_affinity"] and pinned["pinned_cpus"] == 1
    assert free["pinned_cpus"] is None and same


def test_pinning_a_pair_moves_every_thread_of_the_arm_into_its_slot() -> None:
    # sched_setaffinity(0, ...) narrows the calling thread only: the OpenMP pool a parallel op in start-up made
    # (and any other thread started before the first turn) would keep running on the node's other CPUs.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import json, os, threading
        import torch
        from trainers import pairing
        torch.set_num_threads(2)
        torch.ones(1 << 22).mul_(2).sum()          # starts OpenMP's worker threads
        parked = threading.Event()
        threading.Thread(target=parked.wait, daemon=True).start()
        slot = {sorted(os.sched_getaffinity(0))[0]}
        pairing.pin(slot)
        masks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
        parked.set()
        print(json.dumps([sorted(slot), masks]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    slot, masks = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(masks) >= 2, "the child must have run more than one thread for this to test anything"
    assert all(mask == slot for mask in masks.values()), masks


def test_the_prefixed_distributions_are_those_every_metadata_names(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """Only candidates by their dist-info name get their metadata parsed: the result must be what parsing every
    distribution's metadata gives, for prefixes written with '-', '_' or '.', and for a distribution whose
    directory name differs from its metadata name only in case and separators."""
    import importlib.metadata

    dist = tmp_path / "Nvidia.Odd_Name-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-odd-name\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for prefixes in (("nvidia-",), ("py", "ray", "nvidia_"), ("torch", "typing-extensions", "ml.flow"), ("",)):
        monkeypatch.setattr(provenance, "SOFTWARE_PREFIXES", prefixes)
        reference: dict = {}
        for each in importlib.metadata.distributions():
            name = (each.metadata["Name"] or "").lower()
            if name.startswith(prefixes):
                reference[name] = each.version
        assert provenance._prefixed_distributions() == reference, prefixes
    monkeypatch.setattr(provenance, "SOFTWARE_PREFIXES", ("nvidia-",))
    assert provenance._prefixed_distributions()["nvidia-odd-name"] == "1.0"

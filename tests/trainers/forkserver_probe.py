"""Run by the fork server in tests (``python -m tests.trainers.forkserver_probe <out.json> [sleep_s] [exit]``): it
reports what an arm process would inherit, and leaves a module-level mark the next arm must not see."""

import json
import os
import sys
import time

# Before anything of ours imports more: what the server preloaded, exactly as a forked arm starts.
_PRELOADED = {name: name in sys.modules for name in ("torch", "trainers.loop", "torch._dynamo", "deepspeed",
                                                        "ablate.config.load", "psutil", "trainers.host_malloc")}
_LOAD = sys.modules.get("ablate.config.load")
_SCHEMA_BUILT = _LOAD is not None and _LOAD._schema_node.cache_info().currsize > 0

import trainers.loop  # noqa: E402 - after the snapshot above

seen = getattr(trainers.loop, "_probe_mark", None)
trainers.loop._probe_mark = os.getpid()  # type: ignore[attr-defined]
out = {"pid": os.getpid(), "ppid": os.getppid(), "seen_mark": seen, "preloaded": _PRELOADED,
       "env": dict(os.environ), "cwd": os.getcwd(), "affinity": sorted(os.sched_getaffinity(0)),
       "argv": sys.argv[1:], "mapped": sorted({line.split()[-1] for line in open("/proc/self/maps")
                                                if line.split()[-1].startswith("/")})}
from trainers import provenance  # noqa: E402

out["prepared"] = {"lane_schema_built": _SCHEMA_BUILT, "versions_read_by_server": provenance._READ_BY_PARENT,
                   "versions_read_here": provenance.installed_versions(),
                   "software_versions": provenance.software_versions()}
if "TORCHINDUCTOR_CACHE_DIR" in os.environ:  # where this arm would compile into: its own directories
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from triton import knobs

    out["caches"] = {"inductor": cache_dir(), "triton": knobs.cache.dir}
fd = os.environ.get("PROBE_FD")
if fd is not None:
    os.write(int(fd), b"probe")
with open(sys.argv[1], "w") as handle:
    json.dump(out, handle)
print("probe wrote", sys.argv[1], flush=True)
if len(sys.argv) > 2:
    time.sleep(float(sys.argv[2]))
if len(sys.argv) > 3:
    sys.exit(int(sys.argv[3]))

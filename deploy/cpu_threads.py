"""How many CPU threads an engine should use: the cores this process may actually run on.

torch's default is the machine's core count, which is wrong in the two places pdserve
mostly runs on a CPU: a container (its cgroup's ``cpu.max`` quota allows fewer cores than
the host has) and a launcher that pins or shares cores (``taskset``, SLURM's cpusets,
several workers of one host). Oversubscribed, OpenMP's spinning threads made a 64-token
``pdserve generate`` take 90-108 s on 2 cores instead of 10 s. So every command that runs
an engine resolves ``--threads 0`` here: the cores of the process's affinity mask, capped
by the cgroup quota (v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us``), and ``OMP_NUM_THREADS``
when the operator set it. `launch` splits that among the workers it starts on one host.

The right count is not enough: an engine always shares its cores with other processes (its
worker's gRPC service, the router, clients), and OpenMP's default is to spin at every
barrier; a thread whose partner was descheduled spins out its time slice. A colocated
worker with 2 threads on 2 busy cores took 25-34 s for 32 tokens, 2.2-2.7 s with passive
waits (1 thread: 3.2-6.6 s). So every command that runs an engine asks for passive waits
(``OMP_WAIT_POLICY=PASSIVE``) before torch loads, unless the operator chose a policy.
"""

from __future__ import annotations

import math
import os

CGROUP_ROOT = "/sys/fs/cgroup"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_v2_dir(root: str, proc_cgroup: str) -> str | None:
    text = _read(proc_cgroup) or ""
    for line in text.splitlines():
        if line.startswith("0::"):
            return os.path.join(root, line[3:].lstrip("/"))
    return None


def cgroup_cpu_limit(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup"
                     ) -> float | None:
    """Cores the cgroup quota allows (fractional), or None without a quota. Every level
    of a v2 hierarchy up to the root may set one: the smallest wins."""
    limits = []
    d = _cgroup_v2_dir(root, proc_cgroup)
    while d is not None and d.startswith(root):
        text = _read(os.path.join(d, "cpu.max"))
        if text:
            quota, _, period = text.partition(" ")
            if quota != "max" and period:
                limits.append(int(quota) / int(period))
        if os.path.normpath(d) == os.path.normpath(root):
            break
        d = os.path.dirname(d)
    for v1 in ("cpu", "cpu,cpuacct"):
        q = _read(os.path.join(root, v1, "cpu.cfs_quota_us"))  # -1: no quota
        p = _read(os.path.join(root, v1, "cpu.cfs_period_us"))
        if q and p and int(q) > 0:
            limits.append(int(q) / int(p))
    return min(limits) if limits else None


def available_cores(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> int:
    """Whole cores this process may use: its affinity mask, capped by the cgroup quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return max(1, cores)


def passive_omp_waits(env: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """OpenMP threads sleep rather than spin while they wait (see the module docstring);
    takes effect in processes that load torch's OpenMP after this, and in their children.
    The operator's own ``OMP_WAIT_POLICY`` wins."""
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def engine_threads(requested: int, share: int = 1) -> int:
    """The torch thread count for an engine: ``requested`` when > 0, else
    ``$OMP_NUM_THREADS`` when set, else this process's cores divided among ``share``
    engines running side by side on them."""
    if requested < 0:
        raise ValueError(f"--threads: must be >= 0, got {requested}")
    if requested:
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return max(1, int(env) // share)
    return max(1, available_cores() // max(1, share))

"""The `slurm` fixture, a real SLURM on this host: munge, slurmctld and three slurmd as
nodes n[1-3] (several slurmd on one host, each on its own port), under one temporary
directory."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from deploy.ports import free_run

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "sinfo")


def unavailable() -> str:
    """Why SLURM cannot run here ('' when it can)."""
    if os.geteuid() != 0:
        return "SLURM daemons need root (slurmd runs jobs as their user)"
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (.ci/run installs slurm-wlm and munge)"
    return ""


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        r = self.root
        (r / "munge").mkdir(mode=0o700)
        (r / "state").mkdir()
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._run(["munged", "-f", "-S", str(r / "munge" / "sock"), f"--key-file={key}",
                   f"--log-file={r / 'munge' / 'log'}", f"--pid-file={r / 'munge' / 'pid'}",
                   f"--seed-file={r / 'munge' / 'seed'}"])
        base = free_run(4, "0.0.0.0")
        host = socket.gethostname()
        node_line = (f"NodeName=n[1-3] NodeHostname={host} NodeAddr=127.0.0.1 "
                     f"Port=[{base + 1}-{base + 3}] CPUs=1 RealMemory=1000")
        self.conf.write_text(f"""ClusterName=pdtest{base}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={base}
AuthType=auth/munge
AuthInfo=socket={r}/munge/sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool-%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdTimeout=120
KillWait=30
{node_line}
PartitionName=debug Nodes=n[1-3] Default=YES MaxTime=INFINITE State=UP
""")
        self._run(["slurmctld", "-f", str(self.conf)])
        for n in ("n1", "n2", "n3"):
            self._run(["slurmd", "-f", str(self.conf), "-N", n])
        end = time.monotonic() + 60
        while True:
            out = self.cmd("sinfo", "-h", "-o", "%D %t", check=False)
            if out.strip() == "3 idle":
                return
            if time.monotonic() > end:
                raise RuntimeError(f"SLURM nodes not idle after 60 s: {out!r}\n{self.logs()}")
            time.sleep(0.5)

    def _run(self, argv: list[str]) -> None:
        subprocess.run(argv, check=True, env=self.env, capture_output=True, timeout=60)

    def cmd(self, *argv: str, check: bool = True, cwd: Path | None = None) -> str:
        p = subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                           timeout=60, cwd=cwd)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr}")
        return p.stdout

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd-n1.log", "slurmd-n2.log", "slurmd-n3.log"):
            f = self.root / name
            if f.exists():
                out.append(f"--- {name}\n{f.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def _pid(self, name: str) -> int | None:
        f = self.root / name
        try:
            return int(f.read_text().strip())
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        pids = [self._pid(f"slurmd-{n}.pid") for n in ("n1", "n2", "n3")]
        pids += [self._pid("slurmctld.pid"), self._pid("munge/pid")]
        for pid in pids:
            if pid:
                try:
                    os.kill(pid, 15)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + 30
        for pid in pids:
            while pid and _running(pid) and time.monotonic() < end:
                time.sleep(0.2)


def _running(pid: int) -> bool:
    """Not exited. The daemons fork away from us, and where nothing reaps orphans (a
    container whose init does not) an exited one stays a zombie: waiting for its /proc entry
    to go cost this fixture its whole 30 s deadline at every teardown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    why = unavailable()
    if why:
        pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()

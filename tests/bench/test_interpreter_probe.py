"""bench/probes/interpreter_probe.py (the switch-interval A/B of h200_open_points.sh hold_ab):
the settings reach the module it runs, and the module's own arguments pass untouched, flags
and -m among them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[2] / "bench" / "probes" / "interpreter_probe.py"
SHOW = "import gc, sys; print(sys.getswitchinterval(), gc.get_threshold(), sys.argv[1:])\n"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "show.py").write_text(SHOW)
    return subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, timeout=60)


def test_a_module_runs_with_the_settings_and_its_own_flags(tmp_path: Path) -> None:
    r = _run(tmp_path, "--switch-us", "500", "--gc-thresholds", "700,10,100", "-m", "show",
             "--host", "x", "-m", "y")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0.0005 (700, 10, 100) ['--host', 'x', '-m', 'y']"


def test_a_script_runs_and_defaults_stay(tmp_path: Path) -> None:
    r = _run(tmp_path, str(tmp_path / "show.py"), "--flag")
    assert r.returncode == 0, r.stderr
    interval, rest = r.stdout.split(" ", 1)
    assert float(interval) == 0.005 and rest.strip().endswith("['--flag']")


def test_bad_settings_are_refused_naming_them(tmp_path: Path) -> None:
    r = _run(tmp_path, "--switch-us", "0", "-m", "show")
    assert r.returncode == 2 and "--switch-us must be > 0, got 0.0" in r.stderr
    r = _run(tmp_path, "--gc-thresholds", "7,a", "-m", "show")
    assert r.returncode == 2 and "not integers: '7,a'" in r.stderr
    r = _run(tmp_path, "--bogus", "1", "-m", "show")
    assert r.returncode == 2 and "unrecognized option --bogus" in r.stderr
    r = _run(tmp_path, "--switch-us", "5")
    assert r.returncode == 2 and "give -m MODULE or a script" in r.stderr

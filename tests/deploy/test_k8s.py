"""deploy/k8s: every overlay renders with `kubectl kustomize`, validates against a current
Kubernetes schema (kubernetes-validate) and passes checkov (skips justified in the manifests);
the containers' command lines parse with the pdserve CLI the other tests run."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = sorted((REPO / "deploy" / "k8s" / "overlays").iterdir())
TOOLS = REPO / ".venv-tools" / "bin"
K8S_VERSION = "1.32.0"


def _render(overlay: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (.ci/run installs kubernetes-client)")
    out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _tool(name: str) -> str:
    exe = TOOLS / name
    if not exe.exists():
        pytest.skip(f"{exe} missing: .ci/run installs checkov and kubernetes-validate there")
    return str(exe)


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[o.name for o in OVERLAYS])
def test_overlay_validates(overlay: Path, tmp_path: Path) -> None:
    docs = _render(overlay)
    f = tmp_path / "rendered.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    kv = subprocess.run([_tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, str(f)],
                        capture_output=True, text=True, timeout=300)
    assert kv.returncode == 0, kv.stdout + kv.stderr
    ck = subprocess.run([_tool("checkov"), "-f", str(f), "--framework", "kubernetes", "-o",
                         "json", "--quiet", "--compact"], capture_output=True, text=True,
                        timeout=600)
    report = json.loads(ck.stdout) if ck.stdout.strip() else {}
    failed = report.get("results", {}).get("failed_checks", []) if isinstance(report, dict) \
        else []
    assert not failed, [(c["check_id"], c["check_name"], c["resource"]) for c in failed]
    assert ck.returncode == 0, ck.stdout[-3000:] + ck.stderr[-3000:]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[o.name for o in OVERLAYS])
def test_overlay_has_what_a_cluster_needs(overlay: Path) -> None:
    docs = _render(overlay)
    deps = _by_kind(docs, "Deployment")
    assert set(deps) == {"pdserve-router", "pdserve-producer", "pdserve-consumer"}
    svc = _by_kind(docs, "Service")["pdserve-router"]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50051, "http": 8000}
    for name in ("pdserve-producer", "pdserve-consumer"):
        pod = deps[name]["spec"]["template"]
        c = pod["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert pod["spec"]["terminationGracePeriodSeconds"] == 30
        assert "readinessProbe" in c and "livenessProbe" in c
        token = [e for e in c["env"] if e["name"] == "PDSERVE_CLUSTER_TOKEN"][0]
        assert token["valueFrom"]["secretKeyRef"]["name"] == "pdserve-secrets"
    router = deps["pdserve-router"]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"] for e in router["env"]} == {"PDSERVE_CLUSTER_TOKEN", "PDSERVE_API_KEY"}
    pol = _by_kind(docs, "NetworkPolicy")["pdserve-consumer-ingress"]["spec"]["ingress"][0]
    assert {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            for p in pol["from"]} == {"producer", "router"}
    assert 50070 in [p["port"] for p in pol["ports"]]
    # each worker's ports the router dials (gRPC, the plain Outputs stream) are open to it
    policies = _by_kind(docs, "NetworkPolicy")
    for role in ("producer", "consumer"):
        args = deps[f"pdserve-{role}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        rule = policies[f"pdserve-{role}-ingress"]["spec"]["ingress"][0]
        assert "router" in {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                            for p in rule["from"]}
        for flag in ("--port", "--outputs-port"):
            assert int(args[args.index(flag) + 1]) in [p["port"] for p in rule["ports"]], flag
    want = {"1p1d": (1, 1), "2p4d": (2, 4)}[overlay.name]
    assert (deps["pdserve-producer"]["spec"]["replicas"],
            deps["pdserve-consumer"]["spec"]["replicas"]) == want


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[o.name for o in OVERLAYS])
def test_container_command_lines_are_the_cli_the_tests_run(overlay: Path) -> None:
    parser = build_parser()
    seen = set()
    for d in _by_kind(_render(overlay), "Deployment").values():
        c = d["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == ["pdserve"]  # the console script of deploy.cli:main
        argv = [a.replace("$(POD_IP)", "10.0.0.7").replace("$(POD_NAME)", "pod-x")
                for a in c["args"]]
        args = parser.parse_args(argv)  # argparse exits on an unknown flag: the test fails
        seen.add(args.command)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        if args.command == "router":
            assert (args.grpc_port, args.http_port) == (ports["grpc"], ports["http"])
        else:
            assert args.router == "pdserve-router:50051" and args.port == ports["grpc"]
            assert args.metrics_port == ports["metrics"] and args.device == "cuda:0"
            assert args.advertise_host == "10.0.0.7" and args.worker_id == "pod-x"
            if args.command == "consumer":
                assert args.kv_port == ports["kv"]
    assert seen == {"router", "producer", "consumer"}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[o.name for o in OVERLAYS])
def test_no_budget_blocks_a_node_drain(overlay: Path) -> None:
    """A PodDisruptionBudget that keeps every replica of a Deployment (minAvailable: 1 on
    one replica) makes `kubectl drain` of its node wait forever."""
    docs = _render(overlay)
    deps = _by_kind(docs, "Deployment")
    covered = set()
    for name, pdb in _by_kind(docs, "PodDisruptionBudget").items():
        sel = pdb["spec"]["selector"]["matchLabels"]
        matched = [d for d in deps.values()
                   if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert matched, f"{name} selects no Deployment"
        for d in matched:
            replicas = d["spec"]["replicas"]
            covered.add(d["metadata"]["name"])
            if "minAvailable" in pdb["spec"]:
                assert pdb["spec"]["minAvailable"] < replicas, (name, replicas)
            else:
                assert pdb["spec"]["maxUnavailable"] >= 1, name
    multi = {n for n, d in deps.items() if d["spec"]["replicas"] > 1}
    assert covered == multi  # every pool that can lose a pod safely has a budget


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[o.name for o in OVERLAYS])
def test_the_locally_built_image_is_not_pulled_again(overlay: Path) -> None:
    """docs/deployment.md builds the image on the node under a fixed tag: Always would try
    to pull that tag from a registry that does not have it."""
    for d in _by_kind(_render(overlay), "Deployment").values():
        for c in d["spec"]["template"]["spec"]["containers"]:
            assert c["image"] == "ghcr.io/pdserve/pdserve:0.1.0"
            assert c["imagePullPolicy"] == "IfNotPresent", d["metadata"]["name"]

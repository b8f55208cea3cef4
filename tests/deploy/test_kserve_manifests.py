"""deploy/kserve/ checked against KServe's own CRD schemas (vendored in kserve-crds/, KSERVE_VERSION), made strict so
that a field the schema does not declare fails, and against the server it starts: its settings, ports and probes."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from fusedserve.server.app import PROBE_PATHS
from fusedserve.server.config import MODEL_NAME, Settings
from tests.conftest import require_tool

ROOT = Path(__file__).resolve().parents[2]
KSERVE = ROOT / "deploy" / "kserve"
CRDS = Path(__file__).resolve().parent / "kserve-crds"
KSERVE_VERSION = "v0.20.0"
SCHEMAS = {("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): "clusterservingruntime.v1alpha1.json",
           ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice.v1beta1.json"}
# what KServe's Go types read from metadata (the CRD schemas leave it to the API server: `type: object` only)
METADATA_FIELDS = {"name", "namespace", "labels", "annotations"}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def strict(schema):
    """The schema with `additionalProperties: false` on every object that declares its properties and says nothing
    of other fields: the API server drops (or, with --validate=strict, rejects) an undeclared field of a structural
    schema, so a misspelt field is a silent no-op on a cluster and must be an error here. Objects that keep unknown
    fields (x-kubernetes-preserve-unknown-fields) and maps (an additionalProperties schema) stay as they are. The
    CRDs put no properties under anyOf/allOf/oneOf, which additionalProperties would not see."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("items", "additionalProperties"):  # a schema (additionalProperties may also be a bool)
        if key in schema:
            out[key] = strict(schema[key])
    for key in ("properties", "$defs"):  # name -> schema
        if key in schema:
            out[key] = {name: strict(sub) for name, sub in schema[key].items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def list_map_keys(validator, keys, instance, schema):
    """x-kubernetes-list-map-keys, which the API server enforces on a CRD's lists of type map: no two items with the
    same keys (two env entries of one name, two ports of one number)."""
    if validator.is_type(instance, "array"):
        seen = set()
        for item in filter(lambda i: isinstance(i, dict), instance):  # other items fail on their type
            key = tuple(item.get(k) for k in keys)
            if key in seen:
                yield jsonschema.ValidationError(f"duplicate entry for list-map keys {dict(zip(keys, key))}")
            seen.add(key)


KubernetesValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator,
                                                   {"x-kubernetes-list-map-keys": list_map_keys})


@cache
def vendored(api_version: str, kind: str) -> dict:
    return json.loads((CRDS / SCHEMAS[api_version, kind]).read_text())


def validator(doc: dict, strict_fields: bool = True) -> jsonschema.protocols.Validator:
    schema = vendored(doc["apiVersion"], doc["kind"])["schema"]
    return KubernetesValidator(strict(schema) if strict_fields else schema)


def errors(doc: dict, strict_fields: bool = True) -> list[str]:
    found = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
             for e in validator(doc, strict_fields).iter_errors(doc)]
    found += [f"metadata.{k}: not an ObjectMeta field KServe reads" for k in doc.get("metadata", {})
              if k not in METADATA_FIELDS]
    name = doc.get("metadata", {}).get("name", "")
    if not (DNS_LABEL.fullmatch(name) and len(name) <= 63):
        found.append(f"metadata.name: {name!r} is not a DNS label")
    return found


def load(name: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all((KSERVE / name).read_text()) if d]
    return doc


def runtime() -> dict:
    return load("clusterservingruntime.yaml")


def service() -> dict:
    return load("inferenceservice.yaml")


def server_container(doc: dict) -> dict:
    (container,) = [c for c in doc["spec"]["containers"] if c["name"] == "kserve-container"]
    return container


def combinators_with_properties(node) -> bool:
    if isinstance(node, list):
        return any(combinators_with_properties(v) for v in node)
    if not isinstance(node, dict):
        return False
    if any("properties" in json.dumps(node[k]) for k in ("anyOf", "allOf", "oneOf", "not") if k in node):
        return True
    return any(combinators_with_properties(v) for v in node.values())


def test_vendored_schemas_are_the_named_kserve_release():
    for (api_version, kind), _ in SCHEMAS.items():
        data = vendored(api_version, kind)
        assert (data["kserve"], data["apiVersion"], data["kind"]) == (KSERVE_VERSION, api_version, kind)
        assert data["source"].startswith(f"kserve/kserve {KSERVE_VERSION} ")
        KubernetesValidator.check_schema(data["schema"])
        # strict() relies on it: additionalProperties does not see properties declared under a combinator
        assert not combinators_with_properties(data["schema"])
    assert KSERVE_VERSION in (CRDS / "README.md").read_text()


@pytest.mark.parametrize("name", ["clusterservingruntime.yaml", "inferenceservice.yaml"])
def test_manifest_matches_the_kserve_schema(name):
    doc = load(name)
    assert (doc["apiVersion"], doc["kind"]) in SCHEMAS, f"{name}: no schema vendored for {doc['kind']}"
    found = errors(doc)
    assert not found, "\n".join(found)


# (file, where, a field KServe's schema does not have): a typo at the top of spec, one deep in the container, one in
# the InferenceService's model
UNKNOWN_FIELDS = [
    ("clusterservingruntime.yaml", ("spec",), "protocolVersion"),
    ("clusterservingruntime.yaml", ("spec", "containers", 0, "readinessProbe", "httpGet"), "paht"),
    ("inferenceservice.yaml", ("spec", "predictor", "model"), "storageUrl"),
    ("inferenceservice.yaml", ("metadata",), "annotation"),
]


@pytest.mark.parametrize(("name", "where", "field"), UNKNOWN_FIELDS)
def test_an_unknown_field_fails_validation(name, where, field):
    doc = copy.deepcopy(load(name))
    node = doc
    for step in where:
        node = node[step]
    node[field] = "x"
    found = errors(doc)
    assert any(field in e for e in found), f"{'.'.join(map(str, where))}.{field} passed: {found}"
    # and it is the added strictness that catches it: KServe's schema as shipped lets it through (metadata is the
    # API server's to check, which it does for the fields listed in METADATA_FIELDS)
    assert validator(doc, strict_fields=False).is_valid(doc)


def test_a_wrong_type_and_a_duplicate_list_entry_fail_validation():
    doc = copy.deepcopy(runtime())
    server_container(doc)["ports"][0]["containerPort"] = "8000"
    assert any("containerPort" in e and "integer" in e for e in errors(doc)), errors(doc)
    doc = copy.deepcopy(runtime())
    env = server_container(doc)["env"]
    env.append(dict(env[0]))
    assert any("duplicate" in e and env[0]["name"] in e for e in errors(doc)), errors(doc)


def test_maps_stay_open():
    """The strictness goes only where the schema lists its fields: labels, annotations and resource quantities are
    maps of any key, as on a cluster."""
    doc = copy.deepcopy(runtime())
    doc["spec"]["annotations"]["example.com/anything"] = "1"
    server_container(doc)["resources"]["limits"]["example.com/device"] = "1"
    assert not errors(doc), errors(doc)


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


def fill_placeholders(container: dict, isvc: dict) -> dict:
    """What KServe does to the runtime container for one InferenceService (ReplacePlaceholders: the container's JSON
    run through Go's text/template with the InferenceService's metadata); only {{.Name}} is used here."""
    text = json.dumps(container).replace("{{.Name}}", isvc["metadata"]["name"])
    assert "{{" not in text, "a placeholder other than {{.Name}}"
    return json.loads(text)


def test_runtime_serves_both_protocols_from_mnt_models(monkeypatch):
    doc = runtime()
    spec = doc["spec"]
    assert spec["protocolVersions"] == ["v2", "grpc-v2"]
    container = fill_placeholders(server_container(doc), service())
    assert container["image"] == "fusedserve:gpu"
    env = env_of(container)
    assert env["FUSEDSERVE_MODEL"] == "/mnt/models"  # where KServe's storage initializer puts the model
    assert env["FUSEDSERVE_MODEL_NAME"] == service()["metadata"]["name"]
    assert MODEL_NAME.fullmatch(env["FUSEDSERVE_MODEL_NAME"])

    # every variable is a setting, and the server would start with them
    unknown = [k for k in env if k.removeprefix("FUSEDSERVE_").lower() not in Settings.model_fields]
    assert not unknown, f"not settings: {unknown}"
    for key in [k for k in os.environ if k.startswith("FUSEDSERVE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert (settings.model, settings.device, settings.grpc_port) == ("/mnt/models", "cuda", 8001)

    # HTTP first (KServe's Service publishes the first port on 80), gRPC second under a name that makes it h2c
    http, grpc = container["ports"]
    port_arg = container["args"][container["args"].index("--port") + 1]
    assert http["containerPort"] == int(port_arg) and http["name"] == "http"
    assert grpc["containerPort"] == settings.grpc_port and re.search("grpc|h2c", grpc["name"])
    assert spec["annotations"]["prometheus.kserve.io/port"] == port_arg

    for probe, path in (("startupProbe", "/v2/health/ready"), ("readinessProbe", "/v2/health/ready"),
                        ("livenessProbe", "/v2/health/live")):
        assert container[probe]["httpGet"] == {"path": path, "port": "http"}, probe
        assert path in PROBE_PATHS  # open even when API keys are set
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["securityContext"]["runAsNonRoot"] and container["securityContext"]["readOnlyRootFilesystem"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/tmp", settings.cache_dir} <= mounts
    assert {m["name"] for m in container["volumeMounts"]} <= {v["name"] for v in spec["volumes"]}


def test_example_inference_service_uses_the_runtime_in_standard_mode():
    isvc, csr = service(), runtime()
    # Standard, or the name KServe gave it before 0.16; Knative would leave the pod one of its two ports
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] in ("Standard", "RawDeployment")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == csr["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in csr["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in csr["spec"]["protocolVersions"]
    assert model["storageUri"]
    # the drain fits: preStop's sleep, then the longest request the server lets run
    sleep = int(server_container(csr)["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert isvc["spec"]["predictor"]["terminationGracePeriodSeconds"] > sleep + Settings.model_fields["request_timeout_s"].default


def kubectl() -> str:
    return require_tool("kubectl", "FUSEDSERVE_REQUIRE_DEPLOY_TOOLS")


def test_kustomize_sets_the_runtime_image(tmp_path):
    """The documented way to point the runtime at a registry: the images entry `kustomize edit set image
    fusedserve=REGISTRY/fusedserve:TAG` writes reaches the ClusterServingRuntime's container."""
    folder = tmp_path / "kserve"
    folder.mkdir()
    for source in filter(Path.is_file, KSERVE.iterdir()):
        (folder / source.name).write_text(source.read_text())
    result = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    assert yaml.safe_load(result.stdout) == runtime()
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    kustomization["images"] = [{"name": "fusedserve", "newName": "registry.example.com/ml/fusedserve",
                                "newTag": "1.0.0-gpu"}]
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    result = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    assert server_container(rendered)["image"] == "registry.example.com/ml/fusedserve:1.0.0-gpu"
    assert not errors(rendered)

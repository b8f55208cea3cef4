"""Writes the vendored KServe schemas beside this file from a kserve/kserve checkout: the openAPIV3Schema of one
version of each CRD the manifests under deploy/kserve/ use, as KServe ships it, made small without changing its
meaning. Run: python tests/deploy/kserve-crds/extract.py KSERVE_CHECKOUT TAG COMMIT."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections import Counter
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent

# (file under config/crd/full/, version, output): the CRDs deploy/kserve/ instantiates
CRDS = [
    ("serving.kserve.io_clusterservingruntimes.yaml", "v1alpha1", "clusterservingruntime.v1alpha1.json"),
    ("serving.kserve.io_inferenceservices.yaml", "v1beta1", "inferenceservice.v1beta1.json"),
]

# Subtrees this large or larger that occur more than once become one entry of $defs and a $ref: the
# InferenceService schema repeats the whole PodSpec and Container schemas for each predictor kind, which is most
# of its size. A $ref with nothing beside it means exactly the subtree it names, so validation is unchanged.
MIN_SHARED_CHARS = 400


def canonical(node) -> str:
    return json.dumps(node, sort_keys=True, separators=(",", ":"))


def share_repeats(schema: dict) -> dict:
    counts: Counter[str] = Counter()

    def count(node):
        if isinstance(node, dict):
            counts[canonical(node)] += 1
            for value in node.values():
                count(value)
        elif isinstance(node, list):
            for value in node:
                count(value)

    count(schema)
    defs: dict[str, dict] = {}

    def rewrite(node, top=False):
        if isinstance(node, dict):
            text = canonical(node)
            if not top and counts[text] > 1 and len(text) >= MIN_SHARED_CHARS:
                name = hashlib.sha256(text.encode()).hexdigest()[:12]
                if name not in defs:
                    defs[name] = {}  # claimed before the walk, so a subtree is rewritten once
                    defs[name] = {k: rewrite(v) for k, v in node.items()}
                return {"$ref": f"#/$defs/{name}"}
            return {k: rewrite(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    shared = rewrite(schema, top=True)
    # a subtree repeated only inside another shared one is referenced once now: put it back in its place
    uses = Counter(re.findall(r'"#/\$defs/(\w+)"', json.dumps([shared, defs])))

    def inline(node):
        if isinstance(node, dict):
            if set(node) == {"$ref"} and uses[node["$ref"].rsplit("/", 1)[1]] == 1:
                return inline(defs[node["$ref"].rsplit("/", 1)[1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    shared = inline(shared)
    defs = {name: inline(body) for name, body in defs.items() if uses[name] > 1}
    if defs:
        shared["$defs"] = dict(sorted(defs.items()))
    return shared


def main(checkout: str, tag: str, commit: str) -> None:
    for crd_file, version, output in CRDS:
        source = f"config/crd/full/{crd_file}"
        crd = yaml.safe_load((Path(checkout) / source).read_text())
        (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
        vendored = {
            "source": f"kserve/kserve {tag} ({commit}) {source}, spec.versions[{version}].schema.openAPIV3Schema; "
                      f"repeated subtrees moved to $defs by tests/deploy/kserve-crds/extract.py",
            "kserve": tag,
            "apiVersion": f"{crd['spec']['group']}/{version}",
            "kind": crd["spec"]["names"]["kind"],
            "schema": share_repeats(entry["schema"]["openAPIV3Schema"]),
        }
        (HERE / output).write_text(json.dumps(vendored, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])

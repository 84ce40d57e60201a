#!/usr/bin/env python3
"""Writes the JSON schema deploy/validate.sh checks a custom resource kind against, from the
kind's upstream CustomResourceDefinition (one served version's openAPIV3Schema).

    crd_to_schema.py CRD.yaml VERSION SOURCE > kind-group-version.json

The schema is the CRD's structural schema as the API server applies it, made strict the way
`kubernetes-validate --strict` treats built-in kinds: an object that lists its properties
refuses others (unless it says x-kubernetes-preserve-unknown-fields), int-or-string fields take
either, and the x-kubernetes-* extensions (CEL rules, list types) are left out: jsonschema cannot
evaluate them. SOURCE (repository, path and commit) goes into the schema's $comment.
"""

import json
import sys

import yaml


def convert(node):
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("nullable", "description"):
            continue
        if key == "properties":
            out[key] = {name: convert(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = convert(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [convert(v) for v in value]
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def main(path, version, source):
    crd = yaml.safe_load(open(path))
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    schema = convert(served["schema"]["openAPIV3Schema"])
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schema["properties"]["apiVersion"] = {"const": f"{group}/{version}"}
    schema["properties"]["kind"] = {"const": kind}
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
    document = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$comment": f"{kind} ({group}/{version}) from its upstream CRD, {source}, converted by "
                    "deploy/helm/schemas/crd_to_schema.py: kubernetes-validate ships no CRD schemas, "
                    "so deploy/validate.sh checks these objects against this instead.",
        **schema,
    }
    json.dump(document, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])

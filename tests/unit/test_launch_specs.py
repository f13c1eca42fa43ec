"""The cluster files in launch/ against their projects' published schemas (vendored in
tests/data/schemas/, sources in its README.md): Kubeflow Trainer v2's TrainJob, the Training
Operator's PyTorchJob and SkyPilot's task. No cluster is needed; what a schema cannot say
(Kubernetes' CEL rules, whether the image exists, SkyPilot's cloud checks) is not checked here.

Kubernetes drops fields its schema does not know (a typo is silently ignored), so the CRD
schemas are checked as `kubectl apply --validate=strict` does: an object whose schema lists its
properties accepts no others.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from launching import REPO

SCHEMAS = Path(__file__).resolve().parent.parent / "data" / "schemas"


def strict(schema: dict) -> dict:
    """Every object schema with listed properties (and no open map or preserved unknown fields) closed."""
    out = copy.deepcopy(schema)

    def close(node: object) -> None:
        if isinstance(node, dict):
            if node.get("properties") and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(out)
    return out


def _validator(name: str, crd: bool) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    schema = strict(schema) if crd else schema
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)


SPECS = [
    ("k8s-trainjob.yaml", "kubeflow-trainjob-v1alpha1.json", True),
    ("k8s-pytorchjob.yaml", "kubeflow-pytorchjob-v1.json", True),
    ("skypilot.yaml", "skypilot-task.json", False),
]


@pytest.mark.parametrize(("spec", "schema", "crd"), SPECS)
def test_launch_file_follows_its_published_schema(spec: str, schema: str, crd: bool) -> None:
    doc = yaml.safe_load((REPO / "launch" / spec).read_text())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator(schema, crd).iter_errors(doc)]
    assert not errors, errors


@pytest.mark.parametrize(("spec", "schema", "crd"), SPECS)
def test_the_schema_check_catches_a_misspelt_field(spec: str, schema: str, crd: bool) -> None:
    doc = yaml.safe_load((REPO / "launch" / spec).read_text())
    if spec == "skypilot.yaml":
        doc["resources"]["acelerators"] = doc["resources"].pop("accelerators")
    else:
        doc["spec"]["runPolicy" if spec == "k8s-pytorchjob.yaml" else "trainer"]["numNode"] = 2
    assert list(_validator(schema, crd).iter_errors(doc))


def test_every_launcher_runs_the_train_command_with_resume() -> None:
    """Each file starts harness's train command under torchrun and resumes after a restart."""
    for spec, _, _ in SPECS:
        text = (REPO / "launch" / spec).read_text()
        assert "torchrun" in text and "checkpoint.resume=auto" in text, spec
        assert "harness.train" in text or "harness/train.py" in text, spec

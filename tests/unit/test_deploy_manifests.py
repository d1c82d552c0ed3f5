"""Every deploy manifest validated against its schema, offline.

* Core Kubernetes kinds (PersistentVolumeClaim, Service, ...): the strict JSON schemas
  of the PyPI package kubernetes-validate (unknown fields rejected).
* KubeRay kinds (RayJob, RayCluster, RayService): deploy/k8s/schema/kuberay-ray.io-v1.schema.json,
  derived from KubeRay's ray.io/v1 API types, whose pod templates and Services refer to
  the same core Kubernetes schemas, so a typo inside a pod template fails too.
* deploy/ray-cluster.yaml: Ray's own schema (ray/autoscaler/ray-schema.json) after Ray's
  own preparation, exactly as `ray up` checks it.
After editing a manifest, run: .venv/bin/python -m pytest tests/unit/test_deploy_manifests.py
"""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource

from tests.paths import REPO

pytestmark = pytest.mark.unit

ROOT = REPO
K8S_DIR = ROOT / "deploy" / "k8s"
KUBERAY_SCHEMA = K8S_DIR / "schema" / "kuberay-ray.io-v1.schema.json"
RAY_CLUSTER_YAML = ROOT / "deploy" / "ray-cluster.yaml"
# Oldest and newest Kubernetes minor versions the manifests must be valid for.
K8S_VERSIONS = ("1.29", "1.37")
MANIFESTS = sorted(K8S_DIR.glob("*.yaml"))


def kubernetes_validate():
    try:
        import kubernetes_validate as kv
    except ImportError:
        pytest.fail(
            "kubernetes_validate is missing: it comes from the PyPI package kubernetes-validate==1.37.0 "
            "(with importlib-resources), which deploy/setup.sh installs (deploy/requirements.lock); run deploy/setup.sh"
        )
    return kv


@cache
def kuberay_validators(k8s_version: str) -> dict[str, jsonschema.Draft202012Validator]:
    """One validator per KubeRay kind, resolving core refs into kubernetes-validate's strict definitions."""
    kv = kubernetes_validate()
    version = [v for v in kv.utils.all_versions() if kv.utils.major_minor(v) == k8s_version][-1]
    core = kv.utils.schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
    ours = json.loads(KUBERAY_SCHEMA.read_text())
    registry = Registry().with_resources(
        [(core["$id"], Resource.from_contents(core)), (ours["$id"], Resource.from_contents(ours))]
    )
    return {
        kind: jsonschema.Draft202012Validator({"$ref": f"{ours['$id']}#/$defs/{kind}"}, registry=registry)
        for kind in ("RayCluster", "RayJob", "RayService")
    }


def schema_errors(doc: dict, k8s_version: str) -> list[str]:
    """Every schema violation of one manifest document, as 'path: message'; [] when valid."""
    if doc.get("apiVersion") == "ray.io/v1":
        validator = kuberay_validators(k8s_version).get(doc.get("kind"))
        if validator is None:
            return [f"no schema for ray.io/v1 kind {doc.get('kind')!r}"]
        return [
            f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
        ]
    kv = kubernetes_validate()
    try:
        kv.validate(doc, k8s_version, strict=True)
    except kv.ValidationError as e:
        return [f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}"]
    except kv.SchemaNotFoundError as e:  # not a warning here: an unvalidated manifest is a failure
        return [e.message]
    return []


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_documents() -> list[dict]:
    return [d for p in MANIFESTS for d in documents(p)]


def containers(doc: dict) -> list[tuple[str, dict, dict]]:
    """(group, pod spec, container) for every Ray pod template of a RayJob/RayCluster."""
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
    return [(name, g["template"]["spec"], c) for name, g in groups for c in g["template"]["spec"]["containers"]]


def ray_docs() -> list[dict]:
    return [d for d in all_documents() if d.get("apiVersion") == "ray.io/v1"]


# ---------------------------------------------------------------- schema validation


def test_manifest_set_is_complete():
    kinds = sorted(d["kind"] for d in all_documents())
    assert kinds == ["PersistentVolumeClaim", "RayCluster", "RayJob", "Service"]


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_its_schema(path, k8s_version):
    for doc in documents(path):
        assert schema_errors(doc, k8s_version) == [], f"{path.name}: {doc['kind']}/{doc['metadata']['name']}"


def _set(doc: dict, dotted: str, value) -> dict:
    doc = copy.deepcopy(doc)
    *parents, last = dotted.split(".")
    node = doc
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


_DELETE = object()
_HEAD = "spec.rayClusterSpec.headGroupSpec"


@pytest.mark.parametrize(
    "kind,dotted,value,expected",
    [
        # typo'd KubeRay field: rejected by our strict CRD schema
        ("RayJob", "spec.rayClusterSpec.workerGroupSpec", [], "'workerGroupSpec' was unexpected"),
        ("RayJob", f"{_HEAD}.template", _DELETE, "'template' is a required property"),
        ("RayJob", "spec.submissionMode", "Batch", "is not one of ['K8sJobMode', 'HTTPMode', 'InteractiveMode']"),
        ("RayJob", "spec.rayClusterSpec.workerGroupSpecs.0.replicas", -1, "less than the minimum of 0"),
        # typo inside a pod template: rejected by the core Kubernetes schema the CRD schema refers to
        ("RayJob", f"{_HEAD}.template.spec.containers.0.volumeMount", [], "'volumeMount' was unexpected"),
        ("RayCluster", "spec.workerGroupSpecs.0.template.spec.containers.0.image", 7, "7 is not of type 'string'"),
        ("RayCluster", "spec.rayVersion", 2.6, "2.6 is not of type 'string'"),
        # core kinds: kubernetes-validate strict schema
        ("Service", "spec.ports.0.port", "eight-thousand", "'eight-thousand' is not of type 'integer'"),
        ("PersistentVolumeClaim", "spec.accesModes", ["ReadWriteMany"], "'accesModes' was unexpected"),
    ],
)
def test_schema_rejects_broken_manifests(kind, dotted, value, expected):
    (doc,) = [d for d in all_documents() if d["kind"] == kind]
    errors = schema_errors(_set(doc, dotted, value), K8S_VERSIONS[-1])
    assert any(expected in e for e in errors), errors


def test_unknown_kind_is_an_error_not_a_warning():
    assert schema_errors({"apiVersion": "ray.io/v1", "kind": "RayCronJob", "metadata": {"name": "x"}}, "1.37")
    errors = schema_errors({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "x"}}, "1.37")
    assert errors and "Couldn't find schema for kind Widget" in errors[0]


# ---------------------------------------------------------------- what the manifests promise


def _lock_version(package: str) -> str:
    match = re.search(rf"^{package}==(\S+)$", (ROOT / "deploy" / "requirements.lock").read_text(), re.M)
    assert match, f"{package} is not pinned in deploy/requirements.lock"
    return match.group(1)


def test_images_and_ray_version_match_the_project():
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    for doc in ray_docs():
        spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        assert spec["rayVersion"] == _lock_version("ray")
        for group, _, c in containers(doc):
            assert c["image"] == f"lorafleet:{version}", (doc["kind"], group)
    assert yaml.safe_load(RAY_CLUSTER_YAML.read_text())["docker"]["image"] == f"lorafleet:{version}"


def test_gpu_workers_and_cpu_head():
    for doc in ray_docs():
        for group, _, c in containers(doc):
            res = c["resources"]
            if group == "head":
                assert "nvidia.com/gpu" not in res["limits"]
            else:
                gpus = res["limits"]["nvidia.com/gpu"]
                assert gpus == res["requests"]["nvidia.com/gpu"] and int(gpus) == 8, (doc["kind"], group)


def test_every_pod_runs_as_the_image_user_and_mounts_the_state_volume():
    user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "deploy" / "Dockerfile").read_text(), re.M)
    assert user, "deploy/Dockerfile has no numeric USER"
    uid = int(user.group(1))
    (pvc,) = [d for d in all_documents() if d["kind"] == "PersistentVolumeClaim"]
    for doc in ray_docs():
        for group, pod, c in containers(doc):
            sc = pod["securityContext"]
            assert (sc["runAsNonRoot"], sc["runAsUser"], sc["fsGroup"]) == (True, uid, uid), (doc["kind"], group)
            claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
            env = {e["name"]: e.get("value") for e in c["env"]}
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert claims[mounts[env["LORAFLEET_STATE_DIR"]]] == pvc["metadata"]["name"], (doc["kind"], group)
            assert mounts["/dev/shm"] in {v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"}


def test_token_comes_from_the_secret_and_the_job_file_is_mounted_on_the_head():
    for doc in ray_docs():
        (head,) = [c for group, _, c in containers(doc) if group == "head"]
        token = {e["name"]: e for e in head["env"]}["LORAFLEET_API_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"]["name"] == "lorafleet-api-token"
        assert token["valueFrom"]["secretKeyRef"]["key"] == "token"
        mounts = {m["mountPath"]: m for m in head["volumeMounts"]}
        assert "/etc/lorafleet" in mounts
    (job,) = [d for d in ray_docs() if d["kind"] == "RayJob"]
    assert job["spec"]["entrypoint"] == "lorafleet run /etc/lorafleet/job.yaml"


def test_api_service_reaches_the_head_control_plane_port():
    (cluster,) = [d for d in ray_docs() if d["kind"] == "RayCluster"]
    (svc,) = [d for d in all_documents() if d["kind"] == "Service"]
    assert svc["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    (head,) = [c for group, _, c in containers(cluster) if group == "head"]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    (port,) = svc["spec"]["ports"]
    env = {e["name"]: e.get("value") for e in head["env"]}
    assert ports[port["targetPort"]] == port["port"] == int(env["LORAFLEET_PORT"]) == 8000
    assert env["LORAFLEET_HOST"] == "0.0.0.0"
    # The head container runs Ray (generated command, --block stripped), then the control plane.
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert "${KUBERAY_GEN_RAY_START_CMD//--block/}" in head["args"][0]
    assert head["args"][0].endswith("exec lorafleet serve /etc/lorafleet/job.yaml")


# ---------------------------------------------------------------- the VM cluster (Ray's own schema)


def ray_prepared(config: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(config)
    validate_config(prepared)
    return prepared


def test_ray_cluster_yaml_validates_against_rays_schema():
    import ray.autoscaler

    raw = yaml.safe_load(RAY_CLUSTER_YAML.read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(raw, schema)  # as written
    prepared = ray_prepared(raw)  # and as `ray up` prepares and checks it
    node_type = prepared["available_node_types"][prepared["head_node_type"]]
    assert (node_type["min_workers"], node_type["max_workers"]) == (2, 2)
    assert "--num-gpus=0" in " ".join(prepared["head_start_ray_commands"])


@pytest.mark.parametrize(
    "change,expected",
    [
        ({"docker": {"image": "lorafleet:0.1.0", "gpus": True}}, "Additional properties are not allowed ('gpus' was unexpected)"),
        ({"max_workers": "two"}, "'two' is not of type 'integer'"),
        ({"provider": {"head_ip": "192.0.2.10"}}, "'type' is a required property"),
    ],
)
def test_ray_schema_rejects_broken_cluster_yaml(change, expected):
    import ray.autoscaler

    config = {**yaml.safe_load(RAY_CLUSTER_YAML.read_text()), **change}
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    with pytest.raises(jsonschema.ValidationError, match=re.escape(expected)):
        jsonschema.validate(config, schema)


# ---------------------------------------------------------------- the commands the manifests run


def _lorafleet_commands() -> list[list[str]]:
    """Every `lorafleet ...` command line the manifests execute, as argv (after 'lorafleet')."""
    import shlex

    (job,) = [d for d in ray_docs() if d["kind"] == "RayJob"]
    (cluster,) = [d for d in ray_docs() if d["kind"] == "RayCluster"]
    (head,) = [c for group, _, c in containers(cluster) if group == "head"]
    lines = [job["spec"]["entrypoint"], head["args"][0].rsplit("exec ", 1)[1]]
    return [shlex.split(line)[1:] for line in lines]


def _cli_commands() -> set[str]:
    import typer.main

    from api.cli.main import app

    return set(typer.main.get_command(app).commands)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(
            argv,
            id=argv[0],
            marks=pytest.mark.xfail(argv[0] not in _cli_commands(), reason=f"`lorafleet {argv[0]}` is not implemented yet", strict=True),
        )
        for argv in _lorafleet_commands()
    ],
)
def test_manifest_commands_parse_with_the_real_cli(argv):
    # Parse (not run) each command with the CLI's own parser: a renamed sub-command or
    # argument breaks this test instead of a pod at 3 a.m.
    import typer.main

    from api.cli.main import app

    group = typer.main.get_command(app)
    parent = group.context_class(group, info_name="lorafleet")
    sub = group.get_command(parent, argv[0])
    assert sub is not None, f"no sub-command {argv[0]!r}; the CLI has {sorted(_cli_commands())}"
    sub.make_context(argv[0], list(argv[1:]), parent=parent)  # raises a usage error on a bad argv


def test_cli_parse_check_can_fail():
    import typer.main

    from api.cli.main import app

    group = typer.main.get_command(app)
    parent = group.context_class(group, info_name="lorafleet")
    with pytest.raises(Exception, match="No such option: --no-such-flag"):
        group.get_command(parent, "run").make_context("run", ["a.yaml", "b.yaml", "--no-such-flag"], parent=parent)

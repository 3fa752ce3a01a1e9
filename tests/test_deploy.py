"""The deploy recipes (deploy/): every file parses, the KubeRay resources validate strictly against
KubeRay's own CRD schemas (shipped in deploy/kuberay/schema), the cluster-launcher configs against
the installed Ray's own schema, and the fields that make a spot cluster work are what they must be:
spot nodes selected and tolerated, GPUs asked for alike by Kubernetes and by Ray, a preStop that
drains the node as a preemption, a grace period longer than every drain, and a RayJob whose spec
passes elastic_zero's validation."""

import gzip
import json
import os
import re
import tomllib

import jsonschema
import pytest
import ray
import yaml

from elastic_zero.job.spec import spec_from_dict

pytestmark = pytest.mark.unit

DEPLOY = os.path.join(os.path.dirname(__file__), "..", "deploy")
IMAGE = "ghcr.io/elastic-zero/elastic-zero:0.1.0-cu128"


def _docs(name: str) -> list[dict]:
    with open(os.path.join(DEPLOY, name)) as fh:
        return [d for d in yaml.safe_load_all(fh) if d]


def _crd_schema(kind: str) -> dict:
    with gzip.open(os.path.join(DEPLOY, "kuberay", "schema", f"ray.io_{kind}.v1.json.gz")) as fh:
        return json.load(fh)


def _unknown_fields(value, schema: dict, where: str = "") -> list[str]:
    """Fields the schema does not name (kubectl's strict validation), where it names its fields."""
    found = []
    if isinstance(value, dict) and "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        for key, item in value.items():
            if key not in schema["properties"]:
                found.append(f"{where}.{key}")
            else:
                found += _unknown_fields(item, schema["properties"][key], f"{where}.{key}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            found += _unknown_fields(item, schema["additionalProperties"], f"{where}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += _unknown_fields(item, schema["items"], f"{where}[{i}]")
    return found


def _validate_strictly(resource: dict, kind: str) -> None:
    schema = _crd_schema(kind)
    jsonschema.validate(resource, schema)
    assert _unknown_fields(resource, schema) == []


def test_the_strict_validation_catches_a_misspelt_or_mistyped_field():
    """The oracle of the two tests below can fail: a typo and a wrong type are both caught."""
    (cluster,) = _docs("kuberay/raycluster.yaml")
    cluster["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(AssertionError):
        _validate_strictly(cluster, "rayclusters")
    (cluster,) = _docs("kuberay/raycluster.yaml")
    cluster["spec"]["workerGroupSpecs"][0]["minReplicas"] = "zero"
    with pytest.raises(jsonschema.ValidationError):
        _validate_strictly(cluster, "rayclusters")


def _check_spot_cluster(spec: dict) -> None:
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # drivers and coordinators only: it must outlive the workers
    assert "gke-spot" not in json.dumps(head)
    (group,) = spec["workerGroupSpecs"]
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert group["labels"]["ray.io/market-type"] == "spot"
    pod = group["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"} \
        in pod["tolerations"]
    (container,) = pod["containers"]
    assert container["image"] == IMAGE and head["template"]["spec"]["containers"][0]["image"] == IMAGE
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == container["resources"]["requests"]["nvidia.com/gpu"] == group["rayStartParams"]["num-gpus"] == "1"
    env = {e["name"]: e["value"] for e in container["env"]}
    drain_timeout = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
    pre_stop = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert "ray drain-node" in pre_stop and "--reason DRAIN_NODE_REASON_PREEMPTION" in pre_stop
    deadline = float(re.search(r"--deadline-remaining-seconds (\d+)", pre_stop).group(1))
    # Kubernetes kills the pod at the grace period's end: the preStop's drain and then Ray's own
    # drain on SIGTERM must both fit in it
    assert pod["terminationGracePeriodSeconds"] > deadline + drain_timeout
    assert float(env["ELASTIC_ZERO_TERMINATION_GRACE_S"]) < pod["terminationGracePeriodSeconds"]


def test_the_raycluster_is_a_valid_spot_gpu_cluster():
    (cluster,) = _docs("kuberay/raycluster.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    _validate_strictly(cluster, "rayclusters")
    _check_spot_cluster(cluster["spec"])


def test_the_rayjob_runs_elastic_zero_on_a_spec_that_passes_validation():
    config_map, job = _docs("kuberay/rayjob.yaml")
    assert (config_map["apiVersion"], config_map["kind"]) == ("v1", "ConfigMap")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    _validate_strictly(job, "rayjobs")
    _check_spot_cluster(job["spec"]["rayClusterSpec"])
    spec = spec_from_dict(tomllib.loads(config_map["data"]["job.toml"])).validate()
    assert spec.elastic.use_gpu and spec.checkpoint.uri and spec.checkpoint.every
    # the entrypoint runs the spec where the head mounts the ConfigMap
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (volume,) = [v for v in head["volumes"] if v.get("configMap", {}).get("name") == config_map["metadata"]["name"]]
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    entrypoint = job["spec"]["entrypoint"].split()
    assert entrypoint[:3] == ["elastic-zero", "run", f"{mount['mountPath']}/job.toml"]
    assert entrypoint[entrypoint.index("--address") + 1] == "auto"
    # the checkpoints go to a volume every node mounts at the same path
    assert spec.checkpoint.uri.startswith("/checkpoints/")
    for pod in (head, job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]):
        assert any(m["mountPath"] == "/checkpoints" for m in pod["containers"][0]["volumeMounts"])


@pytest.mark.parametrize("name", ["aws-spot.yaml", "gcp-spot.yaml"])
def test_the_cluster_launcher_configs_pass_rays_own_schema_and_ask_for_spot_workers(name):
    (config,) = _docs(f"cluster-launcher/{name}")
    with open(os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")) as fh:
        jsonschema.validate(config, json.load(fh))
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"] == {"CPU": 0}
    (worker,) = [t for n, t in types.items() if n != config["head_node_type"]]
    assert worker["labels"] == {"ray.io/market-type": "spot"}
    node = worker["node_config"]
    if config["provider"]["type"] == "aws":
        assert node["InstanceMarketOptions"]["MarketType"] == "spot"
        assert node["MetadataOptions"]["HttpTokens"] == "required"  # IMDSv2, as the watcher speaks it
        assert config["provider"]["cache_stopped_nodes"] is False
    else:
        assert config["provider"]["type"] == "gcp"
        assert node["scheduling"]["provisioningModel"] == "SPOT"
        assert node["guestAccelerators"][0]["acceleratorCount"] == 1
    assert config["docker"]["image"] == IMAGE
    assert any("--head" in c and "--num-cpus=0" in c for c in config["head_start_ray_commands"])
    assert any("--labels=ray.io/market-type=spot" in c for c in config["worker_start_ray_commands"])


def test_the_dockerfile_builds_on_a_cuda_ray_image_with_cuda_torch_and_the_package():
    with open(os.path.join(DEPLOY, "Dockerfile")) as fh:
        lines = [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]
    base = next(line.split()[1] for line in lines if line.startswith("FROM "))
    ray_version, python, cuda = re.fullmatch(r"rayproject/ray:([\d.]+)-py(\d+)-cu(\d+)", base).groups()
    assert tuple(map(int, ray_version.split("."))) >= (2, 60) and python == "311"
    torch_install = next(line for line in lines if "torch==" in line)
    assert "torch==2.13.0" in torch_install and f"download.pytorch.org/whl/cu{cuda}" in torch_install
    assert any(line.startswith("RUN pip install") and "/home/ray/elastic_zero" in line for line in lines)
    assert IMAGE.endswith(f"-cu{cuda}")


def test_the_recipes_ask_for_the_nodes_that_the_autoscaled_test_cluster_proves():
    """deploy/local-autoscaler/cluster.yaml is the config tests/test_autoscaler.py runs Ray's
    autoscaler (v2) on: a reclaimed node replaced, an idle one given back. The recipes must carry
    the same worker node labels, the job's spec must ask for them, the autoscaler must pack them
    (KubeRay's v2) and give idle nodes back (an idle timeout)."""
    (local,) = _docs("local-autoscaler/cluster.yaml")
    (spot,) = [t for n, t in local["available_node_types"].items() if n != local["head_node_type"]]
    labels = spot["labels"]
    assert labels == {"ray.io/market-type": "spot"} and local["idle_timeout_minutes"] > 0
    for name in ("aws-spot.yaml", "gcp-spot.yaml"):
        (config,) = _docs(f"cluster-launcher/{name}")
        (worker,) = [t for n, t in config["available_node_types"].items() if n != config["head_node_type"]]
        assert worker["labels"] == labels, name
        assert config["idle_timeout_minutes"] > 0, name
        # the cluster launcher's autoscaler (v1 in Ray 2.60) packs resources, not labels: only the spot
        # node type may offer what a worker asks for (the head has neither CPUs nor GPUs to give)
        assert config["available_node_types"][config["head_node_type"]]["resources"] == {"CPU": 0}, name
    (cluster,) = _docs("kuberay/raycluster.yaml")
    config_map, job = _docs("kuberay/rayjob.yaml")
    for spec in (cluster["spec"], job["spec"]["rayClusterSpec"]):
        assert spec["autoscalerOptions"]["version"] == "v2" and spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0
        for group in spec["workerGroupSpecs"]:
            assert group["labels"] == labels and group["template"]["metadata"]["labels"] == labels
    job_spec = spec_from_dict(tomllib.loads(config_map["data"]["job.toml"])).validate()
    assert job_spec.elastic.worker_labels == labels

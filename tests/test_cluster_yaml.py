"""cluster.yaml is a valid Ray cluster-launcher config."""

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[1]


def _schema() -> dict:
    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def test_cluster_yaml_validates_against_rays_schema():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    jsonschema.validate(config, _schema())
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` runs after filling defaults
    gpu = config["available_node_types"]["gpu_8x"]
    assert gpu["node_config"]["InstanceType"].startswith("p4d")
    assert any("--dashboard-host=127.0.0.1" in c for c in config["head_start_ray_commands"])
    assert any("raysc" in c for c in config["setup_commands"])


def test_schema_check_rejects_a_broken_config():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    config["max_workerz"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, _schema())

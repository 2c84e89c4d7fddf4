"""Kubernetes manifests: every overlay renders, validates strictly, and passes only settings the CLI accepts."""

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from prefixpool.deploy.cli import build_parser
from prefixpool.deploy.router_settings import RouterSettings
from prefixpool.deploy.settings import env_name
from prefixpool.deploy.vllm_node_settings import VllmNodeSettings
from prefixpool.deploy.worker_settings import WorkerSettings
from prefixpool.vllm_connector.config import config_from

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
OVERLAYS = ["base", "overlays/cpu", "overlays/kuberay", "overlays/vllm", "overlays/vllm-connector", "overlays/pd",
            "overlays/index-shards", "overlays/vllm-pd"]
SETTINGS_OF = {"worker": WorkerSettings, "router": RouterSettings, "ray": RouterSettings, "vllm-node": VllmNodeSettings}
# Variables the image itself or Kubernetes' downward API needs, not prefixpool settings.
NOT_SETTINGS = {"POD_NAME", "POD_IP"}


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the kustomize overlays"
    out = subprocess.run([kubectl, "kustomize", str(MANIFESTS / overlay)], check=True, capture_output=True, text=True)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def env_names(settings) -> set[str]:
    return {env_name(f.name) for f in dataclasses.fields(settings)}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strictly(overlay):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "StatefulSet", "Service"} <= kinds
    for doc in docs:
        if doc["apiVersion"] == "ray.io/v1":
            assert doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
            continue
        kubernetes_validate.validate(doc, "1.37", strict=True)


def test_base_has_what_the_issue_names():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render("base")}
    etcd = docs[("StatefulSet", "etcd")]
    assert etcd["spec"]["replicas"] == 3 and etcd["spec"]["volumeClaimTemplates"]
    assert docs[("Service", "etcd")]["spec"]["clusterIP"] == "None"
    worker = docs[("StatefulSet", "worker")]["spec"]["template"]["spec"]
    container = worker["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz" and container["livenessProbe"]
    assert worker["terminationGracePeriodSeconds"] >= 10
    router = docs[("Deployment", "router")]
    assert router["spec"]["replicas"] >= 2
    assert ("Service", "router") in docs


def test_drains_fit_in_the_grace_period():
    """preStop plus the drain deadline end before Kubernetes would SIGKILL the pod."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render("base")}
    worker_config = docs[("ConfigMap", "prefixpool-worker")]["data"]
    for kind, name in (("StatefulSet", "worker"), ("Deployment", "router")):
        pod = docs[(kind, name)]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = {**(worker_config if name == "worker" else {}),
               **{e["name"]: e.get("value") for e in container.get("env", [])}}
        deadline = float(env["PREFIXPOOL_DRAIN_DEADLINE_S"])
        command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pre_stop = float(command[1]) if command[:1] == ["sleep"] else 0.0
        assert pre_stop + deadline + 5 <= pod["terminationGracePeriodSeconds"], (name, pre_stop, deadline)


def containers(docs):
    for doc in docs:
        spec = doc.get("spec", {})
        templates = [spec.get("template")] + [spec.get("headGroupSpec", {}).get("template")]
        templates += [g.get("template") for g in spec.get("workerGroupSpecs", [])]
        for template in filter(None, templates):
            yield from template["spec"]["containers"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_flag_and_variable_is_one_the_cli_accepts(overlay):
    docs = render(overlay)
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    checked = 0
    for container in containers(docs):
        if container["image"].split(":")[0] != "prefixpool":
            continue
        args = container.get("args", [])
        component = args[0] if args else "worker"  # Ray nodes run worker actors
        settings = SETTINGS_OF[component]
        names = {e["name"] for e in container.get("env", [])}
        for source in container.get("envFrom", []):
            names |= set(config_maps[source["configMapRef"]["name"]])
        unknown = names - env_names(settings) - NOT_SETTINGS
        assert not unknown, f"{container['name']}: {sorted(unknown)} are not {component} settings"
        if args:
            build_parser(args[0]).parse_args(args)  # exits (SystemExit) on an unknown flag
        checked += 1
    assert checked >= 1


def test_the_common_config_map_is_exactly_the_shared_settings():
    from prefixpool.deploy.common_settings import CommonSettings

    common = next(d for d in render("base")
                  if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "prefixpool-common")
    assert set(common["data"]) == env_names(CommonSettings)


LOOPBACK = ("127.", "localhost", "::1", "[::1]")
ADDRESS_VARS = ("PREFIXPOOL_HOST", "PREFIXPOOL_ADVERTISE_HOST", "PREFIXPOOL_ETCD_ENDPOINTS", "PREFIXPOOL_ETCD_SHARDS")
ADDRESS_FLAGS = ("--router-host", "--etcd-endpoints", "--host", "--advertise-host")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_worker_and_router_advertises_its_pod_ip_and_no_address_is_loopback(overlay):
    docs = render(overlay)
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    runs_workers = 0
    for container in containers(docs):
        if container["image"].split(":")[0] != "prefixpool":
            continue
        env = {e["name"]: e for e in container.get("env", [])}
        values = {name: e.get("value", "") for name, e in env.items()}
        for source in container.get("envFrom", []):
            values.update(config_maps[source["configMapRef"]["name"]])
        args = container.get("args", [])
        given = [values.get(v, "") for v in ADDRESS_VARS]
        given += [args[i + 1] for i, a in enumerate(args[:-1]) if a in ADDRESS_FLAGS]
        for value in given:
            parts = value.replace(";", ",").split(",")  # ';' between index shards
            assert not any(part.strip().startswith(LOOPBACK) for part in parts), (container["name"], value)
        if not args or args[0] in ("worker", "router"):  # a Ray node runs worker actors (the head the router)
            runs_workers += args[:1] != ["router"]
            advertise = env["PREFIXPOOL_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert advertise == "status.podIP", container["name"]
        elif args[0] == "vllm-node":  # the sidecar advertises its vLLM server's URL, built on the pod IP
            runs_workers += 1
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert "$(POD_IP)" in values["PREFIXPOOL_VLLM_URL"], values["PREFIXPOOL_VLLM_URL"]
    assert runs_workers >= 1


def test_the_vllm_overlay_pairs_each_vllm_server_with_its_sidecar():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render("overlays/vllm")}
    assert ("StatefulSet", "worker") not in docs  # vLLM pods replace our workers
    pod = docs[("StatefulSet", "vllm")]["spec"]["template"]["spec"]
    vllm, sidecar = (next(c for c in pod["containers"] if c["name"] == n) for n in ("vllm", "sidecar"))
    kv_config = json.loads(next(a for a in vllm["args"] if a.startswith("--kv-events-config=")).split("=", 1)[1])
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    common = next(d for d in docs.values() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "prefixpool-common")
    assert kv_config["enable_kv_cache_events"] and sidecar["args"] == ["vllm-node"]
    assert env["PREFIXPOOL_KV_EVENTS"].rsplit(":", 1)[1] == kv_config["endpoint"].rsplit(":", 1)[1]
    assert env["PREFIXPOOL_REPLAY_ENDPOINT"].rsplit(":", 1)[1] == kv_config["replay_endpoint"].rsplit(":", 1)[1]
    assert env["PREFIXPOOL_KV_TOPIC"] == kv_config["topic"]
    # the sidecar's namespace must be the one vLLM hashes: same served model and block size
    assert f"--served-model-name={common['data']['PREFIXPOOL_MODEL']}" in vllm["args"]
    assert f"--block-size={common['data']['PREFIXPOOL_BLOCK_SIZE']}" in vllm["args"]
    assert "--enable-prompt-tokens-details" in vllm["args"]  # vLLM reports cached_tokens only with it


def test_the_connector_overlay_gives_each_vllm_pod_a_pool_named_after_its_node():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render("overlays/vllm-connector")}
    pod = docs[("StatefulSet", "vllm")]["spec"]["template"]["spec"]
    vllm, sidecar = (next(c for c in pod["containers"] if c["name"] == n) for n in ("vllm", "sidecar"))
    kv = json.loads(next(a for a in vllm["args"] if a.startswith("--kv-transfer-config=")).split("=", 1)[1])
    assert (kv["kv_connector_module_path"] == "prefixpool.vllm_connector.connector"
            and kv["kv_load_failure_policy"] == "recompute")
    extra = config_from(kv["kv_connector_extra_config"])  # every key one the connector knows
    env = {e["name"]: e["valueFrom"] for e in vllm["env"]}
    sidecar_env = {e["name"]: e.get("valueFrom") for e in sidecar["env"]}
    # "<node>.pool" is how the router pairs a pool with its vLLM node: the same pod name on both sides
    assert extra.node_id == "$(POD_NAME)" and env["POD_NAME"] == sidecar_env["PREFIXPOOL_NODE_ID"]
    assert {"name": "transfer", "containerPort": extra.transfer_port} in vllm["ports"]
    assert "$(PREFIXPOOL_ETCD_ENDPOINTS)" == extra.etcd_endpoints and "PREFIXPOOL_ETCD_ENDPOINTS" in env


def test_the_pd_overlay_runs_prefill_and_decode_workers_that_differ_only_in_role():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render("overlays/pd")}
    pods = {name: docs[("StatefulSet", name)]["spec"]["template"] for name in ("worker", "worker-prefill")}
    env = {name: {e["name"]: e for e in pod["spec"]["containers"][0]["env"]} for name, pod in pods.items()}
    assert {name: e["PREFIXPOOL_ROLE"]["value"] for name, e in env.items()} == {"worker": "decode",
                                                                                "worker-prefill": "prefill"}
    roles = dataclasses.fields(WorkerSettings)
    assert "role" in {f.name for f in roles}  # a setting the worker reads (prefixpool worker --role)
    decode, prefill = (pods[n]["spec"]["containers"][0] for n in ("worker", "worker-prefill"))
    for key in ("image", "args", "envFrom", "ports", "readinessProbe", "livenessProbe", "resources"):
        assert decode[key] == prefill[key], key
    assert {n: e for n, e in env["worker"].items() if n != "PREFIXPOOL_ROLE"} == \
        {n: e for n, e in env["worker-prefill"].items() if n != "PREFIXPOOL_ROLE"}
    labels = {name: pod["metadata"]["labels"]["app.kubernetes.io/name"] for name, pod in pods.items()}
    assert labels["worker"] != labels["worker-prefill"]  # no StatefulSet selects the other's pods
    assert docs[("Service", "worker-prefill")]["spec"]["selector"]["app.kubernetes.io/name"] == labels["worker-prefill"]
    assert docs[("StatefulSet", "worker-prefill")]["metadata"]["namespace"] == docs[("StatefulSet", "worker")][
        "metadata"]["namespace"]


def test_the_index_shards_overlay_names_every_member_of_each_etcd_cluster_once():
    """Shard 0 is the base's etcd and --etcd-endpoints; shard 1 is etcd-shard-1; each shard lists its own
    StatefulSet's pods (name-i.service:2379), and the settings accept the value as every process reads it."""
    from prefixpool.deploy.router_settings import RouterSettings
    from prefixpool.meta.shards import parse_shards

    docs = {(d["kind"], d["metadata"]["name"]): d for d in render("overlays/index-shards")}
    common = docs[("ConfigMap", "prefixpool-common")]["data"]
    shards = parse_shards(common["PREFIXPOOL_ETCD_SHARDS"])
    assert len(shards) == 2 and shards[0] == common["PREFIXPOOL_ETCD_ENDPOINTS"]
    for shard, name in zip(shards, ("etcd", "etcd-shard-1")):
        etcd = docs[("StatefulSet", name)]
        assert docs[("Service", name)]["spec"]["clusterIP"] == "None" and etcd["spec"]["serviceName"] == name
        pods = [f"{name}-{i}.{name}:2379" for i in range(etcd["spec"]["replicas"])]
        assert shard.split(",") == pods and len(pods) == 3
        command = etcd["spec"]["template"]["spec"]["containers"][0]["command"]
        assert f"--initial-cluster-token=prefixpool-{name}" in command
    settings = RouterSettings(etcd_endpoints=common["PREFIXPOOL_ETCD_ENDPOINTS"],
                              etcd_shards=common["PREFIXPOOL_ETCD_SHARDS"])
    assert settings.shard_endpoints == shards


def test_the_vllm_pd_overlay_pairs_producer_and_consumer_servers_with_sidecars_of_those_roles():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render("overlays/vllm-pd")}
    pods = {name: docs[("StatefulSet", name)]["spec"]["template"]["spec"] for name in ("vllm", "vllm-prefill")}
    vllm = {name: next(c for c in pod["containers"] if c["name"] == "vllm") for name, pod in pods.items()}
    sidecar = {name: next(c for c in pod["containers"] if c["name"] == "sidecar") for name, pod in pods.items()}

    def kv_config(container) -> dict:
        return json.loads(next(a for a in container["args"] if a.startswith("--kv-transfer-config=")).split("=", 1)[1])

    assert {n: kv_config(c)["kv_role"] for n, c in vllm.items()} == {"vllm": "kv_consumer",
                                                                     "vllm-prefill": "kv_producer"}
    assert "role" in {f.name for f in dataclasses.fields(VllmNodeSettings)}
    roles = {n: {e["name"]: e.get("value") for e in c["env"]}["PREFIXPOOL_ROLE"] for n, c in sidecar.items()}
    assert roles == {"vllm": "decode", "vllm-prefill": "prefill"}
    extra = {n: config_from(kv_config(c)["kv_connector_extra_config"]) for n, c in vllm.items()}
    assert extra["vllm"] == extra["vllm-prefill"]  # node_id "$(POD_NAME)" on both: "<pod>.pool" per pod
    # the same server otherwise: model, block size, events, image, ports, probes, resources
    without_kv = {n: [a for a in c["args"] if not a.startswith("--kv-transfer-config=")] for n, c in vllm.items()}
    assert without_kv["vllm"] == without_kv["vllm-prefill"]
    for key in ("image", "env", "ports", "volumeMounts", "readinessProbe", "resources"):
        assert vllm["vllm"][key] == vllm["vllm-prefill"][key], key
    others = {n: [e for e in c["env"] if e["name"] != "PREFIXPOOL_ROLE"] for n, c in sidecar.items()}
    assert others["vllm"] == others["vllm-prefill"] and sidecar["vllm"]["args"] == sidecar["vllm-prefill"]["args"]

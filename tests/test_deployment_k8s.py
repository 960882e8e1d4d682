"""The Kubernetes manifests (docker/k8s): every overlay renders with ``kubectl kustomize`` (offline)
and validates against the Kubernetes API schemas (``kubernetes-validate``, strict), and the
rendered objects keep their promises: no secret outside the Secret, a NetworkPolicy that lets
only the learner and the actors reach Redis and only the actors reach the learner's port, actors
named by their pod's ordinal, probes on every container. The entry-point scripts the manifests
mount are run here with stand-ins for the programs they start."""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

from common.entrypoint import parse

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "docker" / "k8s"
OVERLAYS = ("one-node", "multi-node")
TREES = {"base": K8S / "base", **{name: K8S / "overlays" / name for name in OVERLAYS}}
# kubectl's version on the project's machines, and the newest schemas kubernetes-validate has.
KUBERNETES_VERSIONS = ("1.32", "1.37")
PLACEHOLDER = "CHANGE-ME"

kv = pytest.importorskip(
    "kubernetes_validate", reason="pip install kubernetes-validate (dev extra)"
)
pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None,
    reason="kubectl is not installed: the kustomize trees are not rendered (CI has it)",
)


def kustomize(tree: Path) -> list[dict]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(tree)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@cache
def rendered(name: str) -> tuple[dict, ...]:
    return tuple(kustomize(TREES[name]))


def one(docs: tuple[dict, ...] | list[dict], kind: str, prefix: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(prefix)]
    assert len(found) == 1, (kind, prefix, [d["metadata"]["name"] for d in found])
    return found[0]


def config(docs: tuple[dict, ...]) -> dict[str, str]:
    return one(docs, "ConfigMap", "specrl-config-")["data"]


def pod_spec(docs: tuple[dict, ...], kind: str, name: str) -> dict:
    return one(docs, kind, name)["spec"]["template"]["spec"]


def containers(docs: tuple[dict, ...]) -> list[tuple[str, dict]]:
    """(workload name, container) for every container and init container."""
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            spec = d["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec["containers"]:
                out.append((d["metadata"]["name"], c))
    return out


@pytest.mark.parametrize("name", list(TREES))
def test_every_tree_renders_and_validates_strictly(name: str) -> None:
    docs = rendered(name)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["ConfigMap", "ConfigMap", "Secret", "Deployment", "StatefulSet", "StatefulSet"]
        + ["Service"] * 4
        + ["NetworkPolicy"] * 3
    )
    for version in KUBERNETES_VERSIONS:
        for doc in docs:
            kv.validate(doc, version, strict=True)  # raises ValidationError


def test_every_overlay_is_covered() -> None:
    assert sorted(p.name for p in (K8S / "overlays").iterdir()) == sorted(OVERLAYS)


def test_the_validator_rejects_a_broken_object() -> None:
    """Negative control: the schemas are really applied (a bad type, an unknown field)."""
    actor = one(rendered("base"), "StatefulSet", "specrl-actor")
    for broken in ({"replicas": "two"}, {"replicaz": 2}):
        doc = {**actor, "spec": {**actor["spec"], **broken}}
        with pytest.raises(kv.ValidationError):
            kv.validate(doc, KUBERNETES_VERSIONS[0], strict=True)


def secret_values(docs: tuple[dict, ...] | list[dict]) -> tuple[str, dict[str, str]]:
    secret = one(docs, "Secret", "specrl-secrets")
    data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    return secret["metadata"]["name"], {**data, **secret.get("stringData", {})}


def assert_secrets_stay_in_the_secret(docs: tuple[dict, ...] | list[dict]) -> None:
    name, values = secret_values(docs)
    assert set(values) == {
        "redis-password",
        "learner.key",
        "learner.key_secret",
        "actor.key",
        "actor.key_secret",
    }
    for doc in docs:
        if doc["kind"] == "Secret":
            continue
        text = json.dumps(doc)
        for key, value in values.items():
            assert value not in text, f"{key} of the Secret appears in {doc['metadata']['name']}"
    for workload, c in containers(docs):
        assert "password" not in json.dumps([c.get("command"), c.get("args")]).lower()
        for env in c.get("env", []):
            if any(word in env["name"] for word in ("PASSWORD", "AUTH")):
                ref = env["valueFrom"]["secretKeyRef"]  # never a literal value
                assert ref == {"name": name, "key": "redis-password"}, (workload, env)
        for source in c.get("envFrom", []):
            assert "secretRef" not in source  # each secret by name, where it is needed
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for volume in d["spec"]["template"]["spec"].get("volumes", []):
                if "secret" in volume:
                    assert volume["secret"]["secretName"] == name
                    assert volume["secret"]["defaultMode"] == 0o400


@pytest.mark.parametrize("name", list(TREES))
def test_secrets_are_placeholders_and_appear_nowhere_else(name: str) -> None:
    docs = rendered(name)
    _, values = secret_values(docs)
    assert all(v.startswith(PLACEHOLDER) for v in values.values()), values
    assert_secrets_stay_in_the_secret(docs)


def test_an_overlay_replaces_the_secret_as_docs_deploy_says(tmp_path: Path) -> None:
    """The user's overlay of docs/clusters.md: the real password and keys go into a fresh Secret that
    every reference follows, and still nowhere else."""
    password = base64.b16encode(os.urandom(16)).decode().lower()
    keys = tmp_path / "keys"
    keys.mkdir()
    files = {}
    for key in ("learner.key", "learner.key_secret", "actor.key", "actor.key_secret"):
        (keys / key).write_text(f"# {key}\n{base64.b64encode(os.urandom(30)).decode()}\n")
        files[key] = f"keys/{key}"
    (tmp_path / "redis-password").write_text(password)
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(TREES["multi-node"], tmp_path)],
        "secretGenerator": [
            {
                "name": "specrl-secrets",
                "behavior": "replace",
                "files": ["redis-password", *files.values()],
            }
        ],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    docs = kustomize(tmp_path)
    name, values = secret_values(docs)
    assert values["redis-password"] == password
    assert values["actor.key_secret"] == (keys / "actor.key_secret").read_text()
    assert name != secret_values(rendered("multi-node"))[0]  # a new hash: pods roll
    assert PLACEHOLDER not in json.dumps([d for d in docs if d["kind"] != "ConfigMap"])
    assert_secrets_stay_in_the_secret(docs)


def selects(selector: dict, labels: dict[str, str]) -> bool:
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value = labels.get(e["key"])
        ok = {
            "In": value in e.get("values", []),
            "NotIn": value not in e.get("values", []),
            "Exists": e["key"] in labels,
            "DoesNotExist": e["key"] not in labels,
        }[e["operator"]]
        if not ok:
            return False
    return True


def admits(policies: list[dict], src: dict[str, str], dst: dict[str, str], port: int) -> bool:
    """Whether NetworkPolicy lets a pod labelled ``src`` (same namespace) reach ``dst``:``port``."""
    isolating = [
        p
        for p in policies
        if selects(p["spec"]["podSelector"], dst) and "Ingress" in p["spec"]["policyTypes"]
    ]
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            peers = rule.get("from")
            if peers is None or any(selects(peer.get("podSelector", {}), src) for peer in peers):
                return True
    return False


@pytest.mark.parametrize("name", list(TREES))
def test_network_policy_admits_only_the_intended_peers(name: str) -> None:
    docs = rendered(name)
    env = config(docs)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert len(policies) == 3
    labels = {
        "redis": one(docs, "Deployment", "specrl-redis")["spec"]["template"]["metadata"]["labels"],
        "learner": one(docs, "StatefulSet", "specrl-learner")["spec"]["template"]["metadata"][
            "labels"
        ],
        "actor": one(docs, "StatefulSet", "specrl-actor")["spec"]["template"]["metadata"]["labels"],
        "stranger": {"app": "something-else"},
        "scraper": {"specrl.io/metrics-scraper": "true"},
    }
    redis_port, zmq_port = int(env["SPECRL_REDIS_PORT"]), int(env["SPECRL_LEARNER_PORT"])
    learner_metrics = int(env["SPECRL_LEARNER_METRICS_PORT"])
    actor_metrics = int(env["SPECRL_ACTOR_METRICS_PORT"])
    expected = {
        ("redis", redis_port): {"learner", "actor"},
        ("learner", zmq_port): {"actor"},
        ("learner", learner_metrics): {"scraper"},
        ("actor", actor_metrics): {"scraper"},
        ("learner", 22): set(),
        ("actor", zmq_port): set(),
    }
    for (dst, port), allowed in expected.items():
        got = {src for src in labels if admits(policies, labels[src], labels[dst], port)}
        assert got == allowed, (dst, port, got)


@pytest.mark.parametrize("name", list(TREES))
def test_ports_services_and_probes_agree(name: str) -> None:
    docs = rendered(name)
    env = config(docs)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert env["SPECRL_REDIS_HOST"] in services and env["SPECRL_LEARNER_HOST"] in services
    ports = {p["name"]: p["port"] for p in services[env["SPECRL_LEARNER_HOST"]]["spec"]["ports"]}
    assert ports == {
        "zmq": int(env["SPECRL_LEARNER_PORT"]),
        "metrics": int(env["SPECRL_LEARNER_METRICS_PORT"]),
    }
    assert services[env["SPECRL_REDIS_HOST"]]["spec"]["ports"][0]["port"] == int(
        env["SPECRL_REDIS_PORT"]
    )
    for kind, workload in (("StatefulSet", "specrl-learner"), ("StatefulSet", "specrl-actor")):
        assert one(docs, kind, workload)["spec"]["serviceName"] in services
    container_ports = {"redis": "SPECRL_REDIS_PORT", "zmq": "SPECRL_LEARNER_PORT"}
    for workload, c in containers(docs):
        if c["name"].startswith("wait-"):
            continue  # the actors' init container: no server, no probe
        assert "readinessProbe" in c and "livenessProbe" in c, (workload, c["name"])
        named = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        for port_name, key in container_ports.items():
            if port_name in named:
                assert named[port_name] == int(env[key])
        if c["name"] in ("learner", "actor"):
            assert c["startupProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
            assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
            key = f"SPECRL_{c['name'].upper()}_METRICS_PORT"
            assert named["metrics"] == int(env[key])


def test_overlays_request_gpus_and_place_the_actors() -> None:
    one_node, multi_node = rendered("one-node"), rendered("multi-node")
    for docs in (one_node, multi_node):
        env = config(docs)
        learner = pod_spec(docs, "StatefulSet", "specrl-learner")["containers"][0]
        actor = pod_spec(docs, "StatefulSet", "specrl-actor")["containers"][0]
        assert learner["resources"]["limits"]["nvidia.com/gpu"] == int(env["LEARNER_GPUS"]) > 1
        assert actor["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert env["SPECRL_ACTOR_DEVICE"] == "cuda"
    assert "nvidia.com/gpu" not in json.dumps(rendered("base"))
    together = pod_spec(one_node, "StatefulSet", "specrl-actor")["affinity"]["podAffinity"]
    assert together["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == (
        "kubernetes.io/hostname"
    )
    spread = pod_spec(multi_node, "StatefulSet", "specrl-actor")
    assert spread["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    assert "podAntiAffinity" in spread["affinity"]
    replicas = [
        one(rendered(name), "StatefulSet", "specrl-actor")["spec"]["replicas"]
        for name in ("base", "one-node", "multi-node")
    ]
    assert replicas[0] < replicas[1] < replicas[2]


def entrypoint(tmp_path: Path, docs: tuple[dict, ...], script: str) -> Path:
    path = tmp_path / script
    path.write_text(one(docs, "ConfigMap", "specrl-entrypoints-")["data"][script])
    return path


def stand_in(bin_dir: Path, program: str, out: Path) -> None:
    """A program that writes its argv, one per line, to ``out`` and exits 0."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / program
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{out}"\n')
    path.chmod(0o755)


def run_script(script: Path, env: dict[str, str], bin_dir: Path) -> subprocess.CompletedProcess:
    path = f"{bin_dir}:{os.environ['PATH']}"
    return subprocess.run(
        ["sh", str(script)],
        env={"PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_actors_take_their_identity_from_the_pod_ordinal(tmp_path: Path) -> None:
    docs = rendered("multi-node")
    actor = one(docs, "StatefulSet", "specrl-actor")
    spec = actor["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["command"] == ["sh", "/specrl-bin/actor.sh"]
    pod_name = {e["name"]: e for e in container["env"]}["POD_NAME"]
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    script = entrypoint(tmp_path, docs, "actor.sh")
    argv = tmp_path / "argv"
    stand_in(tmp_path / "bin", "specrl-actor", argv)
    env = {**config(docs), "SPECRL_REDIS_PASSWORD": "not-on-the-command-line"}
    name = actor["metadata"]["name"]
    for ordinal in (0, 7):
        done = run_script(script, {**env, "POD_NAME": f"{name}-{ordinal}"}, tmp_path / "bin")
        assert done.returncode == 0, done.stderr
        args = argv.read_text().splitlines()
        assert f"actor.actor_id={name}-{ordinal}" in args and f"actor.index={ordinal}" in args
        assert "not-on-the-command-line" not in argv.read_text()
        cfg = parse(args, "specrl-actor", "")
        assert cfg.actor.index == ordinal and cfg.actor.actor_id == f"{name}-{ordinal}"
        # Actor i serves on metrics_port + i: every pod on the port its probes name.
        assert cfg.actor.metrics_port + cfg.actor.index == int(env["SPECRL_ACTOR_METRICS_PORT"])
        assert cfg.actor.device == "cuda" and cfg.security.curve_dir == env["SPECRL_CURVE_DIR"]
    done = run_script(script, {**env, "POD_NAME": "specrl-actor"}, tmp_path / "bin")
    assert done.returncode == 2 and "ordinal" in done.stderr


def test_the_learner_runs_under_torchrun_above_one_gpu(tmp_path: Path) -> None:
    docs = rendered("one-node")
    script = entrypoint(tmp_path, docs, "learner.sh")
    argv = tmp_path / "argv"
    for program in ("torchrun", "specrl-learner"):
        stand_in(tmp_path / "bin", program, argv)
    env = config(docs)
    done = run_script(script, env, tmp_path / "bin")
    assert done.returncode == 0, done.stderr
    args = argv.read_text().splitlines()
    assert args[:5] == ["--standalone", "--nproc-per-node", env["LEARNER_GPUS"], "-m"] + [
        "learner.main"
    ]
    cfg = parse(args[5:], "specrl-learner", "")
    assert cfg.learner.bind == f"tcp://0.0.0.0:{env['SPECRL_LEARNER_PORT']}"
    assert cfg.redis.url == f"redis://{env['SPECRL_REDIS_HOST']}:{env['SPECRL_REDIS_PORT']}/0"
    assert cfg.security.curve_dir == env["SPECRL_CURVE_DIR"]
    argv.unlink()
    done = run_script(script, {**env, "LEARNER_GPUS": "1"}, tmp_path / "bin")
    assert done.returncode == 0 and argv.read_text().splitlines()[0].startswith("run.name=")


def test_redis_refuses_the_placeholder_and_keeps_the_password_off_argv(tmp_path: Path) -> None:
    docs = rendered("base")
    script = entrypoint(tmp_path, docs, "redis.sh")
    argv = tmp_path / "argv"
    stand_in(tmp_path / "bin", "redis-server", argv)
    env = {**config(docs), "TMPDIR": str(tmp_path)}
    placeholder = secret_values(docs)[1]["redis-password"]
    done = run_script(script, {**env, "REDIS_PASSWORD": placeholder}, tmp_path / "bin")
    assert done.returncode == 2 and "placeholder" in done.stderr and not argv.exists()
    for bad in ("short", "has space in it but long", "quote'in-a-long-password"):
        done = run_script(script, {**env, "REDIS_PASSWORD": bad}, tmp_path / "bin")
        assert done.returncode == 2, bad
    password = base64.b16encode(os.urandom(16)).decode()
    done = run_script(script, {**env, "REDIS_PASSWORD": password}, tmp_path / "bin")
    assert done.returncode == 0, done.stderr
    args = argv.read_text().splitlines()
    conf = tmp_path / "specrl-redis.conf"
    assert args[0] == str(conf) and password not in argv.read_text()
    assert conf.read_text() == f"requirepass {password}\n"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert "--maxmemory-policy" in args and "noeviction" in args


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_entrypoints_pass_shellcheck() -> None:
    scripts = sorted((K8S / "base").glob("*.sh"))
    assert len(scripts) == 4
    done = subprocess.run(
        ["shellcheck", "-s", "sh", *map(str, scripts)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout

"""docker/ checked statically: the files parse, agree with each other and with the daemon.

No Docker engine or cluster runs here, so every check reads the files: the
dashboard and the alerts query only metrics the daemon exports; the image's
ENTRYPOINT, compose's command and the k8s args parse with the real CLI parser;
ports, paths and mounts line up across Dockerfile, compose, Prometheus,
Grafana and k8s; shutdown budgets are longer than the drains they must cover.
The image's HEALTHCHECK one-liner runs against an in-process health server.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from checkpointd.cli import OpsCommand, config_from_args
from checkpointd.core.config import ServeConfig
from checkpointd.metrics import Metrics
from checkpointd.v1 import checkpointd_pb2

ROOT = Path(__file__).resolve().parents[3]
DOCKER = ROOT / "docker"
SERVICE = checkpointd_pb2.DESCRIPTOR.services_by_name["CheckpointService"].full_name
# Series Prometheus itself makes, and PromQL functions the files may use.
PROMETHEUS_SERIES = {"up"}
FUNCTIONS = {
    "abs",
    "avg",
    "clamp_min",
    "count",
    "histogram_quantile",
    "increase",
    "irate",
    "max",
    "max_over_time",
    "min",
    "rate",
    "sum",
    "time",
    "topk",
}
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "inf", "nan"}
_GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
# Upper bound for the healthcheck one-liner (python start + grpc import + a call).
HEALTHCHECK_LIMIT = 30.0


def exported_names() -> set[str]:
    """Every series name a fresh daemon's registry exports, suffixes included."""
    names = set()
    for family in Metrics(CollectorRegistry()).registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the functions a PromQL expression uses."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range durations
    text = re.sub(_GROUPING, "", text)  # label lists
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables
    names, functions = set(), set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", text):
        word = match.group()
        if word.lower() in _KEYWORDS:  # `or (...)` is an operator, not a call
            continue
        if text[match.end() :].lstrip().startswith("("):
            functions.add(word)
        else:
            names.add(word)
    return names, functions


def test_promql_names_finds_metrics_not_labels_ranges_or_functions() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (kind, le) (rate(a_bucket{job="x", kind=~"$k"}'
        "[$__rate_interval]))) / on(instance) group_left max(b_total offset 5m) > bool 0.5"
        ' or (max_over_time(c[6h]) unless on (instance) (up{job="x"} == 1))'
    )

    assert promql_names(expr) == (
        {"a_bucket", "b_total", "c", "up"},
        {"histogram_quantile", "sum", "rate", "max", "max_over_time"},
    )


def _check_promql(expr: str, where: str) -> None:
    names, functions = promql_names(expr)
    unknown = names - exported_names() - PROMETHEUS_SERIES
    assert not unknown, f"{where}: {sorted(unknown)} are not exported by the daemon: {expr}"
    assert functions <= FUNCTIONS, f"{where}: unexpected functions {functions - FUNCTIONS}: {expr}"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


# The dashboard and its provisioning.


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads((DOCKER / "grafana" / "dashboards" / "checkpointd.json").read_text())


def _targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


def test_every_panel_has_queries(dashboard: dict[str, Any]) -> None:
    panels = dashboard["panels"]
    assert panels
    assert len({p["id"] for p in panels}) == len(panels), "panel ids repeat"
    for panel in panels:
        assert panel.get("targets"), f"panel {panel['title']!r} has no targets"
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"panel {panel['title']!r} has an empty query"


def test_every_query_uses_only_metrics_the_daemon_exports(dashboard: dict[str, Any]) -> None:
    for panel, target in _targets(dashboard):
        _check_promql(target["expr"], f"panel {panel['title']!r}")
    for variable in dashboard["templating"]["list"]:
        inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable["definition"])
        assert inner, variable["definition"]
        _check_promql(inner.group(1), f"variable {variable['name']!r}")


def test_dashboard_shows_what_an_operator_watches(dashboard: dict[str, Any]) -> None:
    exprs = [target["expr"] for _, target in _targets(dashboard)]

    def uses(*parts: str) -> bool:
        return any(all(part in expr for part in parts) for expr in exprs)

    for q in ("0.5", "0.99"):
        assert uses(f"histogram_quantile({q}", "checkpointd_save_duration_seconds_bucket", "kind")
    assert uses("checkpointd_saves_total", "by (outcome)")
    assert uses('outcome="skipped"', "/")  # the skip ratio
    assert uses("checkpointd_saves_in_flight")
    assert uses("rate(checkpointd_written_bytes_total")
    assert uses("time() - max by (run) (checkpointd_last_success_timestamp_seconds")  # newest on any daemon
    assert uses("checkpointd_save_phase_duration_seconds", "phase")
    assert uses("histogram_quantile(0.99", "checkpointd_save_phase_duration_seconds_bucket", 'phase="upload"')
    assert uses("rate(checkpointd_store_uploaded_bytes_total")
    assert uses("checkpointd_leases_held", "by (instance)")
    assert uses("increase(checkpointd_leases_lost_total", "by (instance)")
    # Preemptions: saves on notice by outcome, notice to durable, and the daemons draining.
    assert uses("rate(checkpointd_preemption_saves_total", "by (outcome)")
    for q in ("0.5", "0.99"):
        assert uses(f"histogram_quantile({q}", "checkpointd_preemption_notice_to_durable_seconds_bucket", "le")
    assert uses("sum(checkpointd_draining")


def test_every_query_follows_the_daemon_variable_over_a_fleet(dashboard: dict[str, Any]) -> None:
    (variable,) = dashboard["templating"]["list"]
    assert variable["name"] == "instance" and variable["multi"] and variable["includeAll"]
    assert variable["allValue"] == ".*"
    for panel, target in _targets(dashboard):
        selectors = re.findall(r"\b(\w+)\{([^}]*)\}", target["expr"])
        assert selectors, panel["title"]
        for name, matchers in selectors:
            assert 'instance=~"$instance"' in matchers, f"panel {panel['title']!r}: {name} ignores the daemon variable"


def test_the_per_run_panel_and_the_alert_agree(dashboard: dict[str, Any]) -> None:
    (rule,) = [r for r in _rules() if r["alert"] == "CheckpointdRunNotCheckpointing"]
    (panel,) = [p for p in dashboard["panels"] if p["title"].startswith("Seconds since last successful save")]
    (target,) = panel["targets"]

    def shape(expr: str) -> str:
        return re.sub(r"\s+", "", re.sub(r',\s*instance=~"\$instance"', "", expr))

    assert shape(rule["expr"]) == shape(target["expr"]) + ">1800"


def test_dashboard_queries_the_provisioned_datasource(dashboard: dict[str, Any]) -> None:
    provisioning = DOCKER / "grafana" / "provisioning"
    (source,) = load_yaml(provisioning / "datasources" / "prometheus.yml")["datasources"]
    assert source["type"] == "prometheus"
    for panel, target in _targets(dashboard):
        for ref in (panel["datasource"], target["datasource"]):
            assert ref == {"type": "prometheus", "uid": source["uid"]}, panel["title"]


# Prometheus files (promtool itself runs in tests/integration/ops/test_prometheus.py).


def _rules() -> list[dict[str, Any]]:
    groups = load_yaml(DOCKER / "prometheus" / "alerts.yml")["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_every_alert_says_what_to_do_and_uses_exported_metrics() -> None:
    rules = _rules()
    assert {r["alert"] for r in rules} == {
        "CheckpointdRunNotCheckpointing",
        "CheckpointdSkipRatioHigh",
        "CheckpointdSaveFailed",
        "CheckpointdDown",
        "CheckpointdLeaseLost",
        "CheckpointdPreemptionSaveFailed",
    }
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert len(rule["annotations"]["description"]) > 100, rule["alert"]
        _check_promql(rule["expr"], f"alert {rule['alert']}")


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    tests = load_yaml(DOCKER / "prometheus" / "alerts_test.yml")["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    for rule in _rules():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']} is never tested firing"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']} is never tested quiet"


# The image.


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            instructions.append((op.upper(), rest.strip()))
    return instructions


def _args(op: str) -> list[str]:
    return [rest for name, rest in dockerfile() if name == op]


def _exec_form(op: str) -> list[str]:
    (rest,) = _args(op)[-1:]
    value = json.loads(rest)  # shell form is not JSON: signals would go to /bin/sh
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"{op} {rest}"
    return value


def image_serve_config(extra: list[str] | None = None) -> ServeConfig:
    """What `checkpointd serve` runs with in the image: ENTRYPOINT + (extra or CMD)."""
    entrypoint = _exec_form("ENTRYPOINT")
    assert entrypoint[:2] == ["checkpointd", "serve"]
    config, _ = config_from_args(entrypoint[1:] + (_exec_form("CMD") if extra is None else extra))
    assert isinstance(config, ServeConfig)
    return config


def test_image_is_python_311_slim_and_runs_as_a_non_root_user() -> None:
    assert _args("FROM")[0] == "python:3.11-slim"
    user = _args("USER")[-1]
    assert user.split(":")[0] not in ("root", "0"), user
    assert any(re.search(rf"useradd\b[^&]*\b{user}\b", run) for run in _args("RUN")), user


def test_image_installs_the_daemon_extra_the_readme_names() -> None:
    assert any('pip install ".[daemon]"' in run for run in _args("RUN"))
    assert 'pip install ".[daemon]"' in (ROOT / "README.md").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^daemon = \[", pyproject, re.MULTILINE)


def test_image_copies_only_what_exists_and_the_context_lets_through() -> None:
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore, "the context should be an allowlist (no .venv, .git, checkpoints)"
    for copy in _args("COPY"):
        *sources, _ = copy.split()
        for source in sources:
            assert (ROOT / source).exists(), source
            assert source.split("/")[0] in allowed, f"{source} is excluded from the context"


def test_entrypoint_is_exec_form_and_serves_on_all_interfaces_into_the_volume() -> None:
    config = image_serve_config()
    assert config.host == "0.0.0.0" and config.metrics_host == "0.0.0.0"
    assert str(config.root) == "/data"
    assert _args("VOLUME") in (["/data"], ['["/data"]'])
    exposed = {p for rest in _args("EXPOSE") for p in rest.split()}
    assert {str(config.port), str(config.metrics_port)} <= exposed


def _healthcheck_code() -> str:
    (rest,) = _args("HEALTHCHECK")
    options, _, command = rest.partition("CMD ")
    assert "--start-period" in options  # TensorFlow's import takes seconds
    argv = json.loads(command)
    assert argv[:2] == ["python", "-c"], argv
    return argv[2]


@pytest.fixture
def health_server() -> Iterator[tuple[health.HealthServicer, str, grpc.Server]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}", server
    finally:
        server.stop(None)


def _run_healthcheck(address: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _healthcheck_code()],
        env={"CHECKPOINTD_HEALTH_ADDRESS": address, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=HEALTHCHECK_LIMIT,
    )


def test_healthcheck_passes_only_while_the_service_is_serving(
    health_server: tuple[health.HealthServicer, str, grpc.Server],
) -> None:
    servicer, address, server = health_server
    serving = health_pb2.HealthCheckResponse.SERVING
    servicer.set(SERVICE, serving)
    assert _run_healthcheck(address).returncode == 0, _run_healthcheck(address).stderr

    servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)  # draining
    assert _run_healthcheck(address).returncode == 1

    server.stop(None)
    assert _run_healthcheck(address).returncode != 0


def test_healthcheck_defaults_to_the_daemons_port() -> None:
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(_args("ENV"))))
    assert env["CHECKPOINTD_HEALTH_ADDRESS"] == f"127.0.0.1:{image_serve_config().port}"


# Compose.


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(DOCKER / "docker-compose.yml")


def _seconds(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smh])", text))


def _binds(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of the service's bind mounts."""
    binds = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            binds[target] = (DOCKER / source).resolve()
    return binds


def test_compose_builds_the_dockerfile_from_the_repository_root(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) >= {"checkpointd", "prometheus", "grafana"}
    build = compose["services"]["checkpointd"]["build"]
    context = (DOCKER / build["context"]).resolve()
    assert context == ROOT
    assert (context / build["dockerfile"]).resolve() == DOCKER / "Dockerfile"


def test_compose_gives_the_drain_time_to_finish(compose: dict[str, Any]) -> None:
    daemon = compose["services"]["checkpointd"]
    config = image_serve_config(daemon.get("command"))
    assert _seconds(daemon["stop_grace_period"]) > config.notice_window_seconds + config.grace_seconds
    published = {str(p).split(":")[-1] for p in daemon["ports"]}
    assert {str(config.port), str(config.metrics_port)} <= published


def test_compose_mounts_files_that_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for target, source in _binds(service).items():
            assert source.exists(), f"{name}: {source} (for {target}) does not exist"


def test_compose_prometheus_loads_our_config_and_scrapes_the_daemon(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    (flag,) = [c for c in prometheus["command"] if c.startswith("--config.file=")]
    config_path = Path(flag.split("=", 1)[1])
    assert _binds(prometheus)[str(config_path.parent)] == DOCKER / "prometheus"
    config = load_yaml(DOCKER / "prometheus" / "prometheus.yml")
    for rule_file in config["rule_files"]:
        assert (DOCKER / "prometheus" / rule_file).exists()
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "checkpointd"  # the alerts select job="checkpointd"
    (target,) = [t for static in job["static_configs"] for t in static["targets"]]
    host, port = target.split(":")
    assert host in compose["services"]
    assert int(port) == image_serve_config(compose["services"][host].get("command")).metrics_port


def test_compose_grafana_provisions_the_datasource_and_the_dashboard(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    binds = _binds(grafana)
    assert binds["/etc/grafana/provisioning"] == DOCKER / "grafana" / "provisioning"
    provisioning = DOCKER / "grafana" / "provisioning"
    (provider,) = load_yaml(provisioning / "dashboards" / "checkpointd.yml")["providers"]
    assert (binds[provider["options"]["path"]] / "checkpointd.json").exists()
    (source,) = load_yaml(provisioning / "datasources" / "prometheus.yml")["datasources"]
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", source["url"]).groups()
    assert host in compose["services"] and port == "9090"


# Kubernetes.


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict[str, Any]]:
    docs = [
        doc for path in sorted((DOCKER / "k8s").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc
    ]
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs), "one object of each kind expected"
    assert set(by_kind) == {"Deployment", "Service", "PersistentVolumeClaim", "Secret"}
    return by_kind


def _pod(k8s: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return k8s["Deployment"]["spec"]["template"]["spec"]


def _container(k8s: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (container,) = _pod(k8s)["containers"]
    return container


def test_k8s_probes_use_the_grpc_health_service(k8s: dict[str, dict[str, Any]]) -> None:
    container = _container(k8s)
    config = image_serve_config(container["args"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": config.port, "service": SERVICE}, probe
    liveness = container["livenessProbe"]
    # A daemon on notice and then draining is NOT_SERVING; liveness must not kill it.
    assert (
        liveness["periodSeconds"] * liveness["failureThreshold"] > config.notice_window_seconds + config.grace_seconds
    )


def test_k8s_flushes_before_stopping_within_the_grace_period(k8s: dict[str, dict[str, Any]]) -> None:
    container = _container(k8s)
    config = image_serve_config(container["args"])
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["checkpointd", "flush"]
    flush, _ = config_from_args(command[1:])
    assert isinstance(flush, OpsCommand) and flush.timeout is not None
    assert flush.address == f"127.0.0.1:{config.port}"
    grace = _pod(k8s)["terminationGracePeriodSeconds"]
    assert config.notice_window_seconds > 0  # trainers stopped with the daemon get their final save in
    assert grace > flush.timeout + config.notice_window_seconds + config.grace_seconds


def test_k8s_runs_one_daemon_on_its_claim_as_the_image_user(k8s: dict[str, dict[str, Any]]) -> None:
    spec = k8s["Deployment"]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    container = _container(k8s)
    config = image_serve_config(container["args"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config.root)]
    (volume,) = [v for v in _pod(k8s)["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == k8s["PersistentVolumeClaim"]["metadata"]["name"]
    uid = re.search(r"useradd .*--uid (\d+)", " ".join(_args("RUN"))).group(1)
    assert _pod(k8s)["securityContext"]["runAsUser"] == int(uid)
    assert _pod(k8s)["securityContext"]["runAsNonRoot"] is True


def test_k8s_service_exposes_grpc_and_metrics_for_scraping(k8s: dict[str, dict[str, Any]]) -> None:
    service, container = k8s["Service"], _container(k8s)
    config = image_serve_config(container["args"])
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {config.port, config.metrics_port}
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for number, port in ports.items():
        assert named[port["targetPort"]] == number
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(config.metrics_port)
    labels = k8s["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def test_exposed_daemons_are_configured_with_auth(k8s: dict[str, dict[str, Any]]) -> None:
    # Bound to 0.0.0.0, the daemon refuses to start without TLS or tokens.
    container = _container(k8s)
    config = image_serve_config(container["args"])
    assert config.host == "0.0.0.0" and config.token_file is not None
    secret = k8s["Secret"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (volume,) = [v for v in _pod(k8s)["volumes"] if v["name"] == "tokens"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (item,) = volume["secret"]["items"]
    assert str(config.token_file) == f"{mounts['tokens']}/{item['path']}"
    assert item["key"] in secret["stringData"]
    (env,) = [e for e in container["env"] if e["name"] == "CHECKPOINTD_TOKEN"]
    ref = env["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    ops_token = secret["stringData"][ref["key"]]
    assert ops_token in secret["stringData"][item["key"]].split()
    compose_env = load_yaml(DOCKER / "docker-compose.yml")["services"]["checkpointd"]["environment"]
    assert "CHECKPOINTD_TOKENS" in compose_env


# Kubernetes, a fleet: docker/k8s/fleet/, one daemon per node on one S3 bucket.

# What a fleet daemon's exit may take to release its leases: the renewal
# thread's join (up to 10 s, S3Leases.close) and a conditional PUT per run.
LEASE_RELEASE_SECONDS = 15


@pytest.fixture(scope="module")
def fleet() -> dict[str, dict[str, Any]]:
    docs = [
        doc
        for path in sorted((DOCKER / "k8s" / "fleet").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs), "one object of each kind expected"
    assert set(by_kind) == {"DaemonSet", "Service", "ConfigMap", "Secret"}
    return by_kind


def _fleet_pod(fleet: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return fleet["DaemonSet"]["spec"]["template"]["spec"]


def _fleet_container(fleet: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (container,) = _fleet_pod(fleet)["containers"]
    return container


def _expanded_args(fleet: dict[str, dict[str, Any]]) -> list[str]:
    """The container's args with $(VAR) expanded as the kubelet does, from the ConfigMap."""
    container, config_map = _fleet_container(fleet), fleet["ConfigMap"]
    values = {}
    for env in container["env"]:
        ref = env.get("valueFrom", {}).get("configMapKeyRef")
        if ref is not None:
            assert ref["name"] == config_map["metadata"]["name"], env["name"]
            values[env["name"]] = config_map["data"][ref["key"]]
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg) for arg in container["args"]]
    assert not any("$(" in arg for arg in expanded), expanded
    return expanded


def test_k8s_fleet_serves_the_configmaps_bucket_with_credentials_from_the_secret(
    fleet: dict[str, dict[str, Any]],
) -> None:
    container, secret = _fleet_container(fleet), fleet["Secret"]
    config = image_serve_config(_expanded_args(fleet))
    data = fleet["ConfigMap"]["data"]
    assert config.s3_url == data["root"] and config.s3_url.startswith("s3://")
    assert config.s3_endpoint_url == data["endpoint-url"]
    assert config.shm_root is None  # trainers in other pods cannot share this pod's /dev/shm
    env = {e["name"]: e for e in container["env"]}
    for name, key in (("AWS_ACCESS_KEY_ID", "access-key-id"), ("AWS_SECRET_ACCESS_KEY", "secret-access-key")):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], key)
        assert secret["stringData"][key].startswith("REPLACE-WITH-"), "placeholders only, never real keys"
    assert not any(e.get("value") for e in container["env"] if e["name"].startswith("AWS_")), "keys in plain env"
    assert not any("AWS" in arg or "secret" in arg.lower() for arg in container["args"])
    # The staging dir is the pod's own, mounted where --work-dir points.
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config.root)]
    (volume,) = [v for v in _fleet_pod(fleet)["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume


def test_k8s_fleet_matches_the_deployments_probes_shutdown_and_user(
    fleet: dict[str, dict[str, Any]], k8s: dict[str, dict[str, Any]]
) -> None:
    container, pod = _fleet_container(fleet), _fleet_pod(fleet)
    config = image_serve_config(_expanded_args(fleet))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe] == _container(k8s)[probe], probe
        assert container[probe]["grpc"] == {"port": config.port, "service": SERVICE}, probe
    liveness = container["livenessProbe"]
    assert (
        liveness["periodSeconds"] * liveness["failureThreshold"] > config.notice_window_seconds + config.grace_seconds
    )
    flush, _ = config_from_args(container["lifecycle"]["preStop"]["exec"]["command"][1:])
    assert isinstance(flush, OpsCommand) and flush.name == "flush" and flush.timeout is not None
    assert flush.address == f"127.0.0.1:{config.port}"
    # After the preStop flush: the notice window, the drain, then the release of every run lease.
    assert config.notice_window_seconds > 0
    assert pod["terminationGracePeriodSeconds"] >= (
        flush.timeout + config.notice_window_seconds + config.grace_seconds + LEASE_RELEASE_SECONDS
    )
    assert pod["securityContext"] == _pod(k8s)["securityContext"]
    assert container["securityContext"] == _container(k8s)["securityContext"]
    assert fleet["DaemonSet"]["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1


def test_k8s_fleet_trainers_reach_the_daemon_on_their_own_node(fleet: dict[str, dict[str, Any]]) -> None:
    service, container = fleet["Service"], _fleet_container(fleet)
    config = image_serve_config(_expanded_args(fleet))
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    labels = fleet["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert fleet["DaemonSet"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port["port"] == named[port["targetPort"]] == config.port
    annotations = fleet["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(config.metrics_port) == str(named["metrics"])


def test_k8s_fleet_is_exposed_with_the_deployments_tokens(
    fleet: dict[str, dict[str, Any]], k8s: dict[str, dict[str, Any]]
) -> None:
    container = _fleet_container(fleet)
    config = image_serve_config(_expanded_args(fleet))
    assert config.host == "0.0.0.0" and config.token_file is not None
    tokens = k8s["Secret"]["metadata"]["name"]  # docker/k8s/secret.yaml, applied with the fleet
    (volume,) = [v for v in _fleet_pod(fleet)["volumes"] if v["name"] == "tokens"]
    (deployments,) = [v for v in _pod(k8s)["volumes"] if v["name"] == "tokens"]
    assert volume["secret"] == deployments["secret"] and volume["secret"]["secretName"] == tokens
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (item,) = volume["secret"]["items"]
    assert str(config.token_file) == f"{mounts['tokens']}/{item['path']}"
    (env,) = [e for e in container["env"] if e["name"] == "CHECKPOINTD_TOKEN"]
    assert env["valueFrom"]["secretKeyRef"]["name"] == tokens


# Kubernetes, a trainer: docker/k8s/trainer/, an example Job on the fleet.


@pytest.fixture(scope="module")
def trainer() -> dict[str, Any]:
    (job,) = [doc for doc in yaml.safe_load_all((DOCKER / "k8s" / "trainer" / "job.yaml").read_text()) if doc]
    assert job["kind"] == "Job"
    return dict(job)


def test_k8s_trainer_dials_its_nodes_daemon_with_a_token_the_daemon_accepts(
    trainer: dict[str, Any], fleet: dict[str, dict[str, Any]], k8s: dict[str, dict[str, Any]]
) -> None:
    pod = trainer["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    service = fleet["Service"]
    (port,) = service["spec"]["ports"]
    assert env["CHECKPOINTD_ADDRESS"]["value"] == f"{service['metadata']['name']}.$(POD_NAMESPACE).svc:{port['port']}"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    (volume,) = pod["volumes"]
    secret = k8s["Secret"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (item,) = volume["secret"]["items"]
    assert secret["stringData"][item["key"]] in secret["stringData"]["tokens"].split()


def test_k8s_trainer_gets_its_notice_as_sigterm_with_time_for_its_final_save(trainer: dict[str, Any]) -> None:
    pod = trainer["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # A preStop would run before SIGTERM and push the final save past the window of a daemon stopped with it.
    assert "preStop" not in container.get("lifecycle", {})
    assert pod["terminationGracePeriodSeconds"] >= 30  # Kubernetes' default, which the final save's wait fits in

"""docker-compose.yml, the Dockerfile and Grafana's provisioning files hold together.

Docker cannot run here, so these check what `docker compose up` would trip over: services
and their dependencies, healthchecks, host paths that must exist, profstream commands and
options that must parse, and the addresses the services use to find each other.
"""

from __future__ import annotations

import base64
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from profstream.cli import app
from profstream.sinks.grafana import Grafana

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict = COMPOSE["services"]
PROFSTREAM = {name: s for name, s in SERVICES.items() if s.get("build") == "."}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
CLUSTER = {name: s for name, s in SERVICES.items() if "cluster" in s.get("profiles", ())}


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with the variables unset."""
    return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def _command(service: dict) -> list[str]:
    cmd = service["command"]
    return cmd if isinstance(cmd, list) else shlex.split(cmd)


def _option(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _mounts(service: dict) -> dict[str, str]:
    """Bind mounts of a service: container path -> host path (relative to the repo)."""
    out = {}
    for volume in service.get("volumes", ()):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            out[target] = source
    return out


def _published(service: dict, port: int | str) -> bool:
    """Whether ``service`` publishes container port ``port`` on the same host port."""
    return any(p.split(":")[-2:] == [str(port), str(port)] for p in service.get("ports", ()))


def _depends(service: dict) -> dict[str, str]:
    deps = service.get("depends_on", {})
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def test_the_stack_has_every_part_and_pins_its_images():
    assert set(SERVICES) == {"kafka", "processor", "sink-prometheus", "sink-grafana", "sink-archive", "sink-timeline",
                             "autocapture", "prometheus", "alertmanager", "grafana", *CLUSTER}
    assert SERVICES["kafka"]["image"].startswith("apache/kafka:3.9")
    assert SERVICES["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft
    for name, service in SERVICES.items():
        if name in PROFSTREAM:
            assert service["image"] == "profstream:local"
        else:
            image = service["image"]
            assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image version"


def test_dependencies_exist_have_no_cycle_and_wait_for_health_where_health_is_checked():
    for name, service in SERVICES.items():
        for dep, condition in _depends(service).items():
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"
            assert condition in CONDITIONS, f"{name} -> {dep}: {condition}"
            if condition == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep} to be healthy: it has no healthcheck"
    seen: dict[str, int] = {}

    def visit(name: str) -> None:  # depth-first: 1 = on the path, 2 = done
        assert seen.get(name) != 1, f"dependency cycle through {name}"
        if seen.get(name) == 2:
            return
        seen[name] = 1
        for dep in _depends(SERVICES[name]):
            visit(dep)
        seen[name] = 2

    for name in SERVICES:
        visit(name)
    # the order a user needs: broker, then processor (it creates the topics), then the sinks
    assert _depends(SERVICES["processor"]) == {"kafka": "service_healthy", **dict.fromkeys(CLUSTER, "service_healthy")}
    for sink in ("sink-prometheus", "sink-grafana", "sink-archive", "sink-timeline", "autocapture"):
        assert _depends(SERVICES[sink])["processor"] == "service_healthy"
    assert _depends(SERVICES["sink-grafana"])["grafana"] == "service_healthy"


def test_every_service_others_wait_for_or_that_serves_a_port_has_a_healthcheck():
    needed = {dep for s in SERVICES.values() for dep in _depends(s)} | {n for n, s in SERVICES.items() if "ports" in s}
    for name in needed:
        check = SERVICES[name].get("healthcheck")
        assert check, f"{name} has no healthcheck"
        test = check["test"]
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name
        assert {"interval", "timeout", "retries"} <= set(check), name


def test_every_host_path_mounted_or_copied_exists_in_the_repo():
    for name, service in SERVICES.items():
        for source in _mounts(service).values():
            assert not source.startswith("/"), f"{name}: {source} is outside the repo"
            assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repo"
        for volume in service.get("volumes", ()):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in COMPOSE.get("volumes", {}), f"{name}: named volume {source} is not declared"
        for config in service.get("configs", ()):
            assert config["source"] in COMPOSE.get("configs", {}), f"{name}: config {config['source']} undeclared"
        if "build" in service:
            assert (ROOT / service["build"] / "Dockerfile").is_file()
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert re.search(r"pip install \.", dockerfile)
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        for source in line.split()[:-1]:
            assert list(ROOT.glob(source)), f"the Dockerfile copies {source}, which is not in the repo"
            # and .dockerignore lets it through
            ignore = (ROOT / ".dockerignore").read_text().splitlines()
            assert f"!{source.rstrip('/')}" in ignore or f"!{source}" in ignore or f"!{source.rstrip('/')}/" in ignore


def _click_command(words: list[str]):
    command = typer.main.get_command(app)
    for word in words:
        assert word in getattr(command, "commands", {}), f"no command profstream {' '.join(words)}"
        command = command.commands[word]
    return command


@pytest.mark.parametrize("name", sorted(PROFSTREAM))
def test_every_profstream_service_runs_a_real_command_with_options_that_parse(name):
    args = _command(PROFSTREAM[name])
    assert args[0] == "profstream"
    words = [a for a in args[1:3] if not a.startswith("-")]
    options = args[1 + len(words):]
    result = CliRunner().invoke(app, [*words, "--help"])
    assert result.exit_code == 0, result.output
    command = _click_command(words)
    known = {opt for p in command.params for opt in p.opts}
    for flag in (a for a in options if a.startswith("--")):
        assert flag.split("=")[0] in known, f"{name}: profstream {' '.join(words)} has no option {flag}"
    command.make_context(f"profstream {' '.join(words)}", list(options))  # values parse and are in range


def test_the_profstream_services_find_kafka_on_its_advertised_listener():
    env = SERVICES["kafka"]["environment"]
    advertised = dict(item.split("://") for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    for name, service in PROFSTREAM.items():
        assert _interpolate(_option(_command(service), "--bootstrap")) == advertised["PLAINTEXT"], name
    host_port = advertised["HOST"].rsplit(":", 1)[1]
    assert _published(SERVICES["kafka"], host_port)


def test_prometheus_scrapes_the_services_where_they_serve_and_loads_the_rules():
    config = yaml.safe_load(COMPOSE["configs"]["prometheus-config"]["content"])
    (mount,) = [c for c in SERVICES["prometheus"]["configs"] if c["source"] == "prometheus-config"]
    assert f"--config.file={mount['target']}" in SERVICES["prometheus"]["command"]
    mounts = _mounts(SERVICES["prometheus"])
    for rule_file in config["rule_files"]:
        assert mounts.get(rule_file) == "./deploy/prometheus/alerts.yml"
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert targets["profstream-processor"] == [f"processor:{_option(_command(SERVICES['processor']), '--metrics-port')}"]
    assert targets["profstream-exporter"] == [f"sink-prometheus:{_option(_command(SERVICES['sink-prometheus']), '--port')}"]
    (alertmanager,) = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert alertmanager == "alertmanager:9093"
    # the alert rules select on the job names of deploy/prometheus/prometheus.yml
    standalone = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert {j["job_name"] for j in standalone["scrape_configs"]} == set(targets)
    assert _mounts(SERVICES["alertmanager"])["/etc/alertmanager/alertmanager.yml"] == "./deploy/alertmanager.yml"


def test_grafana_is_provisioned_with_the_prometheus_datasource_and_the_generated_dashboards():
    mounts = _mounts(SERVICES["grafana"])
    assert mounts["/etc/grafana/provisioning/datasources"] == "./dashboards/provisioning/datasources"
    assert mounts["/etc/grafana/provisioning/dashboards"] == "./dashboards/provisioning/dashboards"
    datasources = [d for f in sorted((ROOT / "dashboards/provisioning/datasources").glob("*.yml"))
                   for d in yaml.safe_load(f.read_text())["datasources"]]
    (prometheus,) = datasources
    assert prometheus["type"] == "prometheus" and prometheus["isDefault"] is True
    url = urlsplit(prometheus["url"])
    assert url.hostname == "prometheus" and _published(SERVICES["prometheus"], url.port)
    providers = [p for f in sorted((ROOT / "dashboards/provisioning/dashboards").glob("*.yml"))
                 for p in yaml.safe_load(f.read_text())["providers"]]
    (provider,) = providers
    assert provider["type"] == "file"
    host_dir = ROOT / mounts[provider["options"]["path"]]  # the provider reads a mounted directory...
    assert sorted(p.name for p in host_dir.glob("*.json")) == ["cluster.json", "pipeline-health.json",
                                                               "training-run.json"]  # ...holding the dashboards
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (host_dir / Path(home).relative_to(provider["options"]["path"])).is_file()


def test_the_grafana_sink_reaches_grafana_without_showing_its_password():
    env = SERVICES["sink-grafana"]["environment"]
    url = _interpolate(env["PROFSTREAM_GRAFANA_URL"])
    parts = urlsplit(url)
    assert parts.hostname == "grafana" and _published(SERVICES["grafana"], parts.port)
    assert parts.password == _interpolate(SERVICES["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"])
    grafana = Grafana.from_options(environ={"PROFSTREAM_GRAFANA_URL": url,
                                            "PROFSTREAM_GRAFANA_TOKEN": _interpolate(env["PROFSTREAM_GRAFANA_TOKEN"])})
    assert grafana.display_url == "http://grafana:3000"


def test_alertmanager_s_capture_route_reaches_the_autocapture_webhook_with_the_mounted_policy():
    config = yaml.safe_load((ROOT / "deploy" / "alertmanager.yml").read_text())
    (route,) = [r for r in config["route"]["routes"] if r["receiver"] == "profstream-capture"]
    assert route["continue"] is True  # the people get the alerts too
    (receiver,) = [r for r in config["receivers"] if r["name"] == "profstream-capture"]
    url = urlsplit(receiver["webhook_configs"][0]["url"])
    service = SERVICES[url.hostname]
    args = _command(service)
    assert args[:2] == ["profstream", "autocapture"] and int(_option(args, "--webhook-port")) == url.port
    # it listens on the compose network, is not published on the host, and takes Alertmanager's token
    assert url.path == "/alerts" and _option(args, "--addr") == "0.0.0.0" and "ports" not in service
    auth = receiver["webhook_configs"][0]["http_config"]["authorization"]
    assert auth["type"] == "Bearer"
    (am_token,) = [c for c in SERVICES["alertmanager"]["configs"] if c["source"] == "webhook-token"]
    assert Path(am_token["target"]) == Path("/etc/alertmanager") / auth["credentials_file"]  # beside its config
    (own_token,) = [c for c in service["configs"] if c["source"] == "webhook-token"]
    assert own_token["target"] == _option(args, "--token-file")
    assert "PROFSTREAM_WEBHOOK_TOKEN" in COMPOSE["configs"]["webhook-token"]["content"]
    assert _mounts(service)[_option(args, "--policy")] == "./deploy/autocapture.yml"
    assert f"localhost:{url.port}/healthz" in " ".join(service["healthcheck"]["test"])


def _listeners(env: dict, key: str) -> dict[str, str]:
    return dict(item.split("://") for item in env[key].split(","))


def test_the_cluster_profile_is_a_three_node_quorum_that_lists_every_node():
    assert sorted(CLUSTER) == ["kafka-1", "kafka-2", "kafka-3"]
    envs = {name: s["environment"] for name, s in CLUSTER.items()}
    voters = {}
    for name, env in envs.items():
        assert CLUSTER[name]["image"] == SERVICES["kafka"]["image"]
        assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
        node, _, address = zip(*(v.partition("@") for v in env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")))
        voters[name] = dict(zip((int(n) for n in node), address))
    (quorum,) = {tuple(sorted(v.items())) for v in voters.values()}  # every node has the same list...
    controller_port = {name: _listeners(env, "KAFKA_LISTENERS")["CONTROLLER"].rsplit(":", 1)[1]
                       for name, env in envs.items()}
    # ...naming each node once, by its id, service name and controller port
    assert dict(quorum) == {env["KAFKA_NODE_ID"]: f"{name}:{controller_port[name]}" for name, env in envs.items()}
    (cluster_id,) = {env["CLUSTER_ID"] for env in envs.values()}
    assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16  # what kafka-storage format takes
    for name, env in envs.items():
        advertised = _listeners(env, "KAFKA_ADVERTISED_LISTENERS")
        assert advertised["PLAINTEXT"] == f"{name}:9092"
        host_port = advertised["HOST"].rsplit(":", 1)[1]
        assert _published(CLUSTER[name], host_port)
        assert _listeners(env, "KAFKA_LISTENERS")["HOST"] == f":{host_port}"


def test_the_cluster_profile_replicates_as_the_bundled_cluster_does():
    from profstream.kafka.limits import TOPIC_MAX_MESSAGE_BYTES
    from profstream.kafka.topics import replication
    from profstream.stack.properties import BROKER_HEARTBEAT_INTERVAL_MS, BROKER_SESSION_TIMEOUT_MS

    factor, min_insync = replication(len(CLUSTER))
    assert (factor, min_insync) == (3, 2)
    for name, service in CLUSTER.items():
        env = service["environment"]
        assert env["KAFKA_DEFAULT_REPLICATION_FACTOR"] == env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == factor, name
        assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == factor, name
        assert env["KAFKA_MIN_INSYNC_REPLICAS"] == env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == min_insync, name
        assert env["KAFKA_BROKER_SESSION_TIMEOUT_MS"] == BROKER_SESSION_TIMEOUT_MS, name
        assert env["KAFKA_BROKER_HEARTBEAT_INTERVAL_MS"] == BROKER_HEARTBEAT_INTERVAL_MS, name
        assert env["KAFKA_REPLICA_FETCH_MAX_BYTES"] == TOPIC_MAX_MESSAGE_BYTES, name
        assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false", name


def test_no_two_services_publish_the_same_host_port():
    published = [(name, port.split(":")[-2]) for name, s in SERVICES.items() for port in s.get("ports", ())]
    ports = [p for _, p in published]
    assert len(ports) == len(set(ports)), sorted(published)


def test_every_published_port_is_bound_to_loopback_only():
    """Kafka's PLAINTEXT listener, the endpoints and the UIs are for this machine: another
    machine on the network reaches none of them (docs/security.md)."""
    for name, service in SERVICES.items():
        for port in service.get("ports", ()):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_the_profstream_services_reach_the_cluster_by_the_bootstrap_its_header_gives():
    header = (ROOT / "docker-compose.yml").read_text().split("services:")[0]
    (given,) = re.findall(r"PROFSTREAM_KAFKA=(\S+) docker compose --profile cluster up", header)
    assert given.split(",") == [_listeners(s["environment"], "KAFKA_ADVERTISED_LISTENERS")["PLAINTEXT"]
                                for _, s in sorted(CLUSTER.items())]
    for name, service in PROFSTREAM.items():
        assert _option(_command(service), "--bootstrap") == "${PROFSTREAM_KAFKA:-kafka:9092}", name
    deps = SERVICES["processor"]["depends_on"]
    for node in CLUSTER:  # the processor waits for the nodes when the profile is on, and only then
        assert deps[node] == {"condition": "service_healthy", "required": False}
    (host,) = re.findall(r"bootstrap from ((?:localhost:\d+,?)+)", header)
    assert [h.rsplit(":", 1)[1] for h in host.split(",")] == [
        _listeners(s["environment"], "KAFKA_ADVERTISED_LISTENERS")["HOST"].rsplit(":", 1)[1]
        for _, s in sorted(CLUSTER.items())]

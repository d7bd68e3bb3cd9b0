"""Documentation that must stay true to the code."""

from __future__ import annotations

import re
from pathlib import Path

from profstream.config import MONITOR_OPTIONS

ROOT = Path(__file__).resolve().parent.parent


def test_every_monitor_option_is_documented_with_its_variable_and_default():
    doc = (ROOT / "docs" / "monitor.md").read_text()
    for opt in MONITOR_OPTIONS:
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{opt.name}` |")), None)
        assert row is not None, f"docs/monitor.md lacks option {opt.name}"
        assert f"`{opt.env}`" in row
        if not callable(opt.default) and opt.default is not None:
            assert repr(opt.default) in row, f"docs/monitor.md shows a stale default for {opt.name}"
    documented = set(re.findall(r"^\| `(\w+)` \| `PROFSTREAM_", doc, re.M))
    assert documented == {o.name for o in MONITOR_OPTIONS}


def test_readme_names_exactly_the_two_setup_commands():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def _documented_commands() -> list[list[str]]:
    """The command lines of docs/deploy.md's "Running each component by hand", comments out."""
    import shlex

    doc = (ROOT / "docs" / "deploy.md").read_text()
    section = doc[doc.index("## Running each component by hand"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if shlex.split(line, comments=True)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_documented_component_command_runs(tmp_path):
    """docs/deploy.md's commands: every profstream one parses (options that exist, values they
    take), and Prometheus and Alertmanager start with the project's configuration as shown,
    Prometheus with its rules and an Alertmanager expected on localhost:9093."""
    import subprocess

    from typer.main import get_command

    from profstream.cli import app
    from tests.test_alert_rules import prometheus_tool

    commands = _documented_commands()
    assert [c[0] for c in commands].count("profstream") >= 7
    for argv in (c for c in commands if c[0] == "profstream"):
        command = get_command(app)
        ctx = command.make_context("profstream", argv[1:])
        while hasattr(command, "resolve_command"):  # down to the subcommand, parsing each level's options
            name, command, rest = command.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
            ctx = command.make_context(name, rest, parent=ctx)
        assert not hasattr(command, "commands"), argv  # a command, not a group left without one
    servers = {c[0]: c for c in commands if c[0] in ("prometheus", "prometheus-alertmanager")}
    assert set(servers) == {"prometheus", "prometheus-alertmanager"}
    subprocess.run([prometheus_tool("amtool", "prometheus-alertmanager"), "check-config",
                    str(ROOT / "deploy" / "alertmanager.yml")], check=True, capture_output=True, timeout=60)
    for binary, argv in servers.items():
        _run_as_documented(binary, argv, tmp_path)


def _run_as_documented(binary: str, argv: list[str], tmp_path) -> None:
    """Start ``binary`` with its documented flags (on a free port, storage in tmp_path: the
    docs' paths are ./...), wait until it is ready; Prometheus must have the project's rules
    and expect its Alertmanager on localhost:9093."""
    import json
    import subprocess
    import urllib.request

    from tests.helpers import wait_until
    from tests.test_alert_rules import prometheus_tool

    port = _free_port()
    args = [f"--web.listen-address=127.0.0.1:{port}" if a.startswith("--web.listen-address=")
            else f"{a.split('=', 1)[0]}={tmp_path / binary}" if a.startswith(("--storage.tsdb.path=", "--storage.path="))
            else a for a in argv[1:]]
    log_path = tmp_path / f"{binary}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([prometheus_tool(binary, binary), *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        def ready() -> bool:
            assert proc.poll() is None, log_path.read_text()[-2000:]
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).status == 200
            except OSError:
                return False

        def api(path: str):
            return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/{path}", timeout=5).read())["data"]

        wait_until(ready, 60, f"{binary} as docs/deploy.md starts it")
        if binary == "prometheus":
            assert "localhost:9093" in api("status/config")["yaml"]  # where it expects the Alertmanager
            groups = wait_until(lambda: api("rules")["groups"], 30, "the rules")
            assert {"RunSilent", "DataQueueStall", "ProcessorStalled"} <= {r["name"] for g in groups for r in g["rules"]}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

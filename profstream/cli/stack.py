"""`profstream stack up / status / down / kill-broker / start-broker`: the local Kafka."""

from __future__ import annotations

from typing import Annotated

import typer

from profstream.cli.common import DirOpt, err, out, stack_app

TimeoutOpt = Annotated[float, typer.Option(help="seconds to wait for the broker(s)")]


@stack_app.command("up")
def stack_up_cmd(dir: DirOpt = None, timeout: TimeoutOpt = 120.0,
                 brokers: Annotated[int | None, typer.Option(
                     min=1, max=9, help="brokers of a new cluster on loopback (default 1; 3 is the tested "
                                        "cluster); an existing one keeps its own")] = None,
                 secure: Annotated[bool, typer.Option(
                     "--secure", help="a broker as production runs one: SASL_SSL with SCRAM-SHA-512 users, mutual "
                                      "TLS, ACLs (a CA and certificates made on the spot); prints the client "
                                      "properties file of each user (docs/security.md)")] = False) -> None:
    """Start the local broker or cluster (or reuse the one running) and print its bootstrap address."""
    from profstream.stack import stack_up
    from profstream.stack.secure import is_secure
    from profstream.stack.state import resolve_state_dir

    stack = stack_up(dir, timeout=timeout, brokers=brokers, secure=secure)
    out.print(stack.bootstrap, highlight=False)
    state_dir = resolve_state_dir(dir)
    if is_secure(state_dir):
        _print_secure(state_dir)


def _print_secure(state_dir) -> None:
    """Where the secured broker's client properties are, on stderr (stdout keeps the address)."""
    from profstream.kafka.acls import ROLES
    from profstream.stack.secure import ADMIN, client_connection, secure_dir

    d = secure_dir(state_dir)
    mtls = client_connection(state_dir, ADMIN, mtls=True).bootstrap
    err.print(f"secured: SASL_SSL (SCRAM-SHA-512) on {client_connection(state_dir).bootstrap}, mutual TLS on {mtls}, "
              f"ACLs on. Client properties (--kafka-config): {d}/<user>.properties (SCRAM), "
              f"{d}/<user>-mtls.properties (certificate); users {ADMIN} (super user) and the roles "
              f"{', '.join(ROLES)}, with their ACLs on the topics of prefix profstream", highlight=False, soft_wrap=True)
    out.print(f"{d}/{ADMIN}.properties", highlight=False)


@stack_app.command("status")
def stack_status_cmd(dir: DirOpt = None) -> None:
    """Print the local broker's address and pid, or each broker of a cluster; exit 1 when
    none (or, for a cluster, not every one) is running, saying when the quorum is lost."""
    from profstream.stack import Cluster, stack_status
    from profstream.stack.cluster import cluster_status, holds_cluster
    from profstream.stack.state import resolve_state_dir

    state_dir = resolve_state_dir(dir)
    if holds_cluster(state_dir):
        _cluster_status(cluster_status(state_dir))
        return
    broker = stack_status(state_dir)
    if broker is None or isinstance(broker, Cluster):
        out.print("not running")
        raise typer.Exit(1)
    out.print(f"running  bootstrap={broker.bootstrap}  pid={broker.pid}  dir={broker.state_dir}", highlight=False)
    from profstream.stack.secure import client_connection, is_secure

    if is_secure(state_dir):
        from profstream.stack import StackError, wait_for_broker

        conn = client_connection(state_dir)
        try:
            wait_for_broker(conn, 5.0)
            answer = "answers"
        except StackError as e:
            answer = f"does not answer: {e}"
        out.print(f"secured  {conn.describe()} {answer}  client properties={conn.source}", highlight=False,
                  soft_wrap=True)


def _cluster_status(cluster) -> None:
    from profstream.stack.probe import live_brokers

    n = len(cluster.nodes)
    running = cluster.running
    out.print(f"cluster of {n} brokers  bootstrap={cluster.bootstrap}  dir={cluster.state_dir}", highlight=False)
    for node in cluster.nodes:
        role = "broker+controller" if node.controller else "broker"
        if node.running:
            listed = live_brokers(node.bootstrap, 2.0)
            state = "running" if listed is not None else "running, not answering"
            detail = f"pid={node.pid}" + (f"  sees {listed} of {n} brokers" if listed is not None else "")
        else:
            state, detail = "down", ""
        out.print(f"  broker {node.node_id}  {state:<22} {node.bootstrap:<16} {role:<18} {detail}".rstrip(),
                  highlight=False)
    if not running:
        out.print("not running")
        raise typer.Exit(1)
    down = [str(node.node_id) for node in cluster.nodes if not node.running]
    if not cluster.quorum:
        voters = cluster.controllers
        err.print(f"[red]error:[/red] the cluster has lost its quorum: {sum(c.running for c in voters)} of "
                  f"{len(voters)} controllers run, {len(voters) // 2 + 1} are needed; start brokers "
                  f"{', '.join(down)} with `profstream stack start-broker ID` or all with `profstream stack up`",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    if down:
        err.print(f"{len(running)} of {n} brokers run (down: {', '.join(down)}); the quorum holds; "
                  "`profstream stack start-broker ID` starts one again", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


@stack_app.command("down")
def stack_down_cmd(dir: DirOpt = None) -> None:
    """Stop the local broker (every broker of a cluster)."""
    from profstream.stack import stack_down

    out.print("stopped" if stack_down(dir) else "not running")


@stack_app.command("kill-broker")
def stack_kill_broker_cmd(broker_id: Annotated[int, typer.Argument(min=1, metavar="ID", help="broker id (1..N)")],
                          dir: DirOpt = None) -> None:
    """kill -9 one broker (a fault for testing: no controlled shutdown)."""
    from profstream.stack import kill_broker

    pid = kill_broker(dir, broker_id)
    out.print(f"killed broker {broker_id} (pid {pid})", highlight=False)


@stack_app.command("start-broker")
def stack_start_broker_cmd(broker_id: Annotated[int, typer.Argument(min=1, metavar="ID", help="broker id (1..N)")],
                           dir: DirOpt = None, timeout: TimeoutOpt = 120.0) -> None:
    """Start one broker again, with its ports and data, and wait until it answers."""
    from profstream.stack import start_broker

    broker = start_broker(dir, broker_id, timeout=timeout)
    out.print(f"broker {broker_id} running  bootstrap={broker.bootstrap}  pid={broker.pid}", highlight=False)

"""A broker's ``server.properties``: one node of a KRaft cluster on loopback.

A single broker is node 1 of a cluster of one. In a cluster the first three nodes are
combined broker + controller (the quorum: a majority of them must run), the others are
brokers only; the internal topics are replicated like profstream's own
(:func:`profstream.kafka.topics.replication`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from profstream.kafka.limits import TOPIC_MAX_MESSAGE_BYTES
from profstream.kafka.topics import replication
from profstream.stack.state import DATA_DIR

MAX_CONTROLLERS = 3
# A dead broker's partitions get new leaders once the controllers have missed its
# heartbeats for broker.session.timeout.ms (Kafka's default 9 s of the 15 s a leader kill may
# cost profstream, docs/cluster.md). Loopback brokers whose heartbeats can only be late for
# CPU: 3 s, a heartbeat every 0.75 s. Shorter risks fencing a live broker on a starved box.
BROKER_SESSION_TIMEOUT_MS = 3000
BROKER_HEARTBEAT_INTERVAL_MS = 750
FAILOVER = f"""
# Failover (a cluster only): see profstream/stack/properties.py and docs/cluster.md
broker.session.timeout.ms={BROKER_SESSION_TIMEOUT_MS}
broker.heartbeat.interval.ms={BROKER_HEARTBEAT_INTERVAL_MS}
"""


@dataclass(frozen=True)
class NodeConfig:
    """What differs between the nodes of one cluster."""

    node_id: int
    port: int
    controller_port: int
    voters: str  # controller.quorum.voters: "1@127.0.0.1:PORT,2@..."
    brokers: int = 1  # nodes in the cluster
    ssl_port: int = 0  # a secured broker (stack/secure.py): its mutual-TLS listener; ``port`` is SASL_SSL

    @property
    def secure(self) -> bool:
        return self.ssl_port != 0

    @property
    def controller(self) -> bool:
        return self.node_id <= MAX_CONTROLLERS


def quorum_voters(controller_ports: dict[int, int]) -> str:
    """``controller.quorum.voters`` of the controllers among ``{node id: controller port}``."""
    return ",".join(f"{n}@127.0.0.1:{p}" for n, p in sorted(controller_ports.items()) if n <= MAX_CONTROLLERS)


def server_properties(state_dir: Path, node: NodeConfig) -> str:
    data = state_dir / DATA_DIR
    factor, min_insync = replication(node.brokers)
    if node.controller:
        roles = "broker,controller"
        listeners = f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}"
    else:
        roles = "broker"
        listeners = f"PLAINTEXT://127.0.0.1:{node.port}"
    failover = ""
    security = ""
    advertised, inter, protocols = f"PLAINTEXT://127.0.0.1:{node.port}", "PLAINTEXT", "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    if node.secure:
        from profstream.stack.secure import server_properties as secured

        settings = secured(state_dir, node.port, node.ssl_port, node.controller_port)
        listeners, advertised = settings.pop("listeners"), settings.pop("advertised.listeners")
        inter, protocols = settings.pop("inter.broker.listener.name"), settings.pop("listener.security.protocol.map")
        security = "\n# Secured (profstream stack up --secure, profstream/stack/secure.py)\n" + "".join(
            f"{k}={v}\n" for k, v in settings.items())
    if node.brokers == 1:
        title = "# Single-node KRaft broker in combined mode, loopback only."
    else:
        title = (f"# Node {node.node_id} of a {node.brokers}-broker KRaft cluster on loopback "
                 f"({'broker and controller' if node.controller else 'broker only'}).")
        failover = FAILOVER
    return f"""\
# Written by profstream (profstream.stack); rewritten on every start.
{title}
process.roles={roles}
node.id={node.node_id}
controller.quorum.voters={node.voters}
listeners={listeners}
advertised.listeners={advertised}
inter.broker.listener.name={inter}
controller.listener.names=CONTROLLER
listener.security.protocol.map={protocols}
log.dirs={data}

num.network.threads=3
num.io.threads=4
num.recovery.threads.per.data.dir=1
num.partitions=1
default.replication.factor={factor}
auto.create.topics.enable=false
delete.topic.enable=true
min.insync.replicas={min_insync}
offsets.topic.replication.factor={factor}
offsets.topic.num.partitions=4
transaction.state.log.replication.factor={factor}
transaction.state.log.min.isr={min_insync}
transaction.state.log.num.partitions=4
group.initial.rebalance.delay.ms=0

# Modest disk use: a dev/test broker, not a store of record.
log.segment.bytes=67108864
log.retention.hours=24
log.retention.bytes=536870912
log.retention.check.interval.ms=60000
log.cleaner.dedupe.buffer.size=16777216
# profstream.kafka.limits: what profstream's topics take
message.max.bytes={TOPIC_MAX_MESSAGE_BYTES}
replica.fetch.max.bytes={TOPIC_MAX_MESSAGE_BYTES}
{failover}{security}"""

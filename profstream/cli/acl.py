"""`profstream acl show / apply`: each role's least-privilege ACLs (docs/security.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from profstream.cli.common import (
    BootstrapOpt,
    KafkaConfigOpt,
    KafkaPropertyOpt,
    PrefixOpt,
    acl_app,
    connect,
    err,
    fail,
    out,
)

RoleOpt = Annotated[str, typer.Option(help="trainer (a training job's Monitor), processor, sink, capture (a person's "
                                           "`profstream capture`) or autocapture")]
UserOpt = Annotated[str, typer.Option(help="the principal's user name (User:<name>): its SASL username, or the CN of "
                                           "its certificate")]
GroupOpt = Annotated[list[str] | None, typer.Option(
    "--group", help="the role's consumer group (processor: its --group-id, also the prefix of its groups and "
                    "transactional ids; sink: each sink's --group-id; default: profstream's defaults)")]


@acl_app.command("show")
def acl_show(role: RoleOpt, user: UserOpt, topic_prefix: PrefixOpt = "profstream", group: GroupOpt = None,
             kafka_acls: Annotated[bool, typer.Option("--kafka-acls", help="as kafka-acls.sh commands")] = False) -> None:
    """Print the ACLs a role needs (nothing more), one a line."""
    from profstream.kafka.acls import role_acls
    from profstream.kafka.topics import Topics, validate_prefix

    try:
        acls = role_acls(role, user, Topics(validate_prefix(topic_prefix)), tuple(group or ()))
    except ValueError as e:
        fail(str(e))
    for acl in acls:
        out.print(acl.kafka_acls() if kafka_acls else acl.line(), highlight=False, soft_wrap=True)


@acl_app.command("apply")
def acl_apply(role: RoleOpt, user: UserOpt, bootstrap: BootstrapOpt = None, kafka_config: KafkaConfigOpt = None,
              kafka_property: KafkaPropertyOpt = None, topic_prefix: PrefixOpt = "profstream",
              group: GroupOpt = None) -> None:
    """As an admin (--kafka-config of a super user): create the topics of the prefix (and the request topic of a
    capture or autocapture user) and give the role's ACLs to the user."""
    from profstream.kafka.acls import ROLES, grant

    if role not in ROLES:
        fail(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
    conn, topics = connect(bootstrap, topic_prefix)
    from profstream.stack.errors import StackError

    try:
        acls = grant(conn, role, user, topics, tuple(group or ()))
    except (RuntimeError, ValueError, StackError) as e:
        fail(str(e))
    err.print(f"{len(acls)} ACLs for User:{user} as {role} on {conn}:", highlight=False)
    for acl in acls:
        out.print(acl.line(), highlight=False, soft_wrap=True)

"""The broker's log4j configuration, and the telling line of its logs when a start fails."""

from __future__ import annotations

import os
import re
from pathlib import Path

from profstream.stack.errors import StackError
from profstream.stack.state import CONSOLE_LOG, LOG_DIR, SERVER_LOG


def log4j_properties(log_file: Path) -> str:
    noisy = [
        "kafka.request.logger",
        "kafka.network.RequestChannel$",
        "kafka.network.Processor",
        "kafka.controller",
        "kafka.log.LogCleaner",
        "state.change.logger",
        "kafka.authorizer.logger",
        "kafka.coordinator",
        "kafka.log",
        "kafka.cluster",
        "kafka.server.ReplicaFetcherManager",
        "kafka.server.ReplicaAlterLogDirsManager",
        "kafka.server.metadata",
        "kafka.utils.Log4jControllerRegistration$",
        "org.apache.kafka.storage",
        "org.apache.kafka.raft",
        "org.apache.kafka.controller",
        "org.apache.kafka.image",
        "org.apache.kafka.metadata",
        "org.apache.kafka.clients",
        "org.apache.kafka.common.utils.AppInfoParser",
        "org.apache.kafka.coordinator",
        "org.apache.kafka.common.metrics",
        "org.apache.kafka.queue",
        "kafka.server.DelayedOperationPurgatory$ExpiredOperationReaper",
        "kafka.server.ClientQuotaManager$ThrottledChannelReaper",
        "kafka.server.NodeToControllerRequestThread",
        "kafka.raft",
        "org.apache.kafka.server.util.timer",
        "org.apache.zookeeper",
        # KafkaConfig dumps ~400 lines of settings at each start; server.properties has them.
        "kafka.server.KafkaConfig",
        "org.apache.kafka.common.config",
    ]
    lines = [
        "# Written by profstream on every start.",
        "log4j.rootLogger=INFO, file",
        "log4j.appender.file=org.apache.log4j.RollingFileAppender",
        f"log4j.appender.file.File={log_file}",
        "log4j.appender.file.MaxFileSize=20MB",
        "log4j.appender.file.MaxBackupIndex=3",
        "log4j.appender.file.layout=org.apache.log4j.PatternLayout",
        "log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n",
    ]
    lines += [f"log4j.logger.{name}=WARN" for name in noisy]
    return "\n".join(lines) + "\n"


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def lines_since(path: Path, offset: int, limit: int = 256 * 1024) -> list[str]:
    """Non-empty lines of ``path`` written after byte ``offset`` (at most ``limit`` bytes)."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size < offset:  # rotated or truncated: take what is there
                offset = 0
            fh.seek(max(offset, size - limit))
            text = fh.read().decode(errors="replace")
    except OSError:
        return []
    return [ln for ln in text.splitlines() if ln.strip()]


_EXC_LINE = re.compile(r"^(?:Caused by: )?[\w$.]+(?:Exception|Error)(?::\s|$)")


def failure_hint(lines: list[str]) -> str:
    """The most telling line of a failed start: the first Java exception, else an ERROR."""
    stripped = [ln.strip() for ln in lines]
    for pick in (
        [ln for ln in stripped if _EXC_LINE.match(ln)],
        [ln for ln in stripped if re.search(r"\b(ERROR|FATAL)\b|^Error:", ln)],
        stripped[-1:],
    ):
        if pick:
            hint = pick[0]
            return hint if len(hint) <= 240 else hint[:237] + "..."
    return "no log output"


def startup_failure(state_dir: Path, what: str, offsets: tuple[int, int]) -> StackError:
    log_file = state_dir / LOG_DIR / SERVER_LOG
    console = state_dir / LOG_DIR / CONSOLE_LOG
    con_lines = lines_since(console, offsets[0])
    log_lines = lines_since(log_file, offsets[1])
    hint = failure_hint(con_lines + log_lines)
    detail = "\n".join(
        [f"==> {console} <=="] + con_lines[-40:] + [f"==> {log_file} <=="] + log_lines[-60:]
    )
    return StackError(f"{what}: {hint}; see {log_file} and {console}", detail=detail)

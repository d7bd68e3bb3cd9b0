"""The rule for names that become Kafka keys, file names and metric labels (run ids,
hosts, devices): checked by the Monitor's options and again where batches are decoded, so
that a foreign producer cannot bring a name the Monitor would refuse."""

from __future__ import annotations

import re

NAME_RULE = "1-128 letters, digits or . _ : = + @ - (starting with a letter or digit; no '/', spaces or control characters)"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:=+@-]{0,127}")


def is_valid_name(value: object) -> bool:
    return isinstance(value, str) and _NAME_RE.fullmatch(value) is not None

"""Whether a processor's consumer is still a member of its group, from librdkafka's statistics.

librdkafka can leave a consumer outside its group for good after a broker restart. Seen in
the fault suite and reproduced on its own: the consumer's session times out while the
broker is away; the processor is busy rebuilding and serves the revocation of its lost
partitions only after the broker is back (25 s later in the reproduction); librdkafka then
unassigns and sits in join state ``init`` (or in a coordinator query that finds "no broker
available") and never sends a JoinGroup again: the group stays empty, the consumer's
assignment stays empty, the loop polls nothing, and no error is ever raised. A new consumer
with the same static membership joins at once. So the loop watches the group state that
librdkafka's statistics report every :data:`STATS_INTERVAL_MS` and replaces the consumer
once it has not been joined for :data:`STUCK_AFTER_S`.

Joined means the coordinator is known (state ``up``) and a join is under way or done (any
join state but ``init``). A join waiting for slow members (``wait-join``, up to the
rebalance timeout) counts as joined: that wait is Kafka's, not a stuck client. A real
outage also looks unjoined; replacing the consumer then costs nothing but the new client.
"""

from __future__ import annotations

import json

STATS_INTERVAL_MS = 5000
STUCK_AFTER_S = 20.0


class GroupWatch:
    """Fed librdkafka's statistics JSON (the consumer's ``stats_cb``, served on the loop's
    thread inside ``consume()``); says when the consumer has been out of its group too long.
    Time is the statistics' own (librdkafka's ``ts``): statistics queued while the loop was
    busy elsewhere are judged by when the consumer wrote them, not when they were served."""

    def __init__(self) -> None:
        # one watch per consumer: it gets STUCK_AFTER_S from its first statistics to join
        self._joined_ts: float | None = None  # the last statistics that showed it joined
        self._seen_ts: float | None = None
        self.state = "new"
        self.joined = False  # seen in its group (statistics) since created or last told otherwise
        self.fetch: dict[int, str] = {}  # assigned partition -> its fetch state and offsets (for a state dump)

    def update(self, stats_json: str) -> None:
        stats = json.loads(stats_json)
        cgrp = stats.get("cgrp")
        if cgrp is None:
            return
        ts = stats["ts"] / 1e6
        self.state = f"{cgrp.get('state')}/{cgrp.get('join_state')}"
        self._seen_ts = ts
        joined = cgrp.get("state") == "up" and cgrp.get("join_state") != "init"
        if self._joined_ts is None or joined:
            self._joined_ts = ts
        self.joined = self.joined or joined
        self.fetch = {int(p): f"{s.get('fetch_state')} next {s.get('next_offset')} app {s.get('app_offset')} "
                              f"lso {s.get('ls_offset')} hw {s.get('hi_offset')} leader {s.get('leader')} "
                              f"queued {s.get('fetchq_cnt')}"
                      for t in stats.get("topics", {}).values() for p, s in t.get("partitions", {}).items()
                      if p != "-1" and s.get("fetch_state") not in (None, "none")}

    def stuck_for(self) -> float | None:
        """Seconds out of the group once past :data:`STUCK_AFTER_S`, else None."""
        if self._seen_ts is None or self._joined_ts is None:
            return None
        out = self._seen_ts - self._joined_ts
        return out if out > STUCK_AFTER_S else None

"""GroupWatch: when librdkafka's statistics say a consumer has been out of its group too long."""

from __future__ import annotations

import json

from profstream.processors.group_watch import STUCK_AFTER_S, GroupWatch


def _stats(t_s: float, state: str, join_state: str) -> str:
    """The parts of librdkafka's statistics JSON the watch reads (``ts`` in microseconds)."""
    return json.dumps({"ts": int(t_s * 1e6), "type": "consumer",
                       "cgrp": {"state": state, "stateage": 0, "join_state": join_state, "assignment_size": 0}})


def _feed(watch: GroupWatch, states: list[tuple[float, str, str]]) -> None:
    for t, state, join in states:
        watch.update(_stats(t, state, join))


def test_a_consumer_never_seen_joined_for_longer_than_the_limit_is_stuck():
    watch = GroupWatch()
    _feed(watch, [(100 + 5 * i, "query-coord", "init") for i in range(6)])  # 25 s, as after a broker restart
    assert watch.stuck_for() == 25.0 and watch.state == "query-coord/init"


def test_joined_again_in_time_is_not_stuck():
    watch = GroupWatch()
    _feed(watch, [(0, "up", "steady"), (5, "query-coord", "init"), (15, "up", "init"), (20, "up", "wait-join"),
                  (40, "up", "steady")])
    assert watch.stuck_for() is None


def test_waiting_for_other_members_to_join_counts_as_joined():
    watch = GroupWatch()
    _feed(watch, [(5 * i, "up", "wait-join") for i in range(20)])  # a slow member: Kafka's wait, not ours
    assert watch.stuck_for() is None


def test_up_but_never_joining_again_is_stuck_once_past_the_limit():
    watch = GroupWatch()
    _feed(watch, [(0, "up", "steady"), (5, "up", "init"), (STUCK_AFTER_S, "up", "init")])
    assert watch.stuck_for() is None  # exactly the limit: not yet
    _feed(watch, [(STUCK_AFTER_S + 5, "up", "init")])
    assert watch.stuck_for() == STUCK_AFTER_S + 5


def test_time_is_the_statistics_own_so_a_late_served_backlog_is_not_stuck():
    watch = GroupWatch()
    # the loop did not poll for a minute: the backlog is served at once, its last one joined
    _feed(watch, [(0, "up", "steady"), (5, "query-coord", "init"), (60, "up", "steady")])
    assert watch.stuck_for() is None


def test_statistics_without_a_group_say_nothing():
    watch = GroupWatch()
    watch.update(json.dumps({"ts": 1, "type": "consumer"}))
    assert watch.stuck_for() is None and watch.state == "new"
    _feed(watch, [(0, "query-coord", "init"), (30, "query-coord", "init")])
    assert watch.stuck_for() == 30.0


def test_joined_says_whether_the_consumer_was_seen_in_its_group_since_it_was_reset():
    watch = GroupWatch()
    _feed(watch, [(0, "query-coord", "init"), (5, "up", "init")])  # the first statistics are no join
    assert not watch.joined
    _feed(watch, [(10, "up", "steady")])
    assert watch.joined
    watch.joined = False  # a recovery that reached no broker: Kafka must be heard from again
    _feed(watch, [(15, "query-coord", "init")])
    assert not watch.joined

"""Options: precedence, validation and the one-line errors a user sees."""

from __future__ import annotations

import json
import logging

import pytest

from profstream.config import (
    MONITOR_OPTIONS,
    ConfigError,
    Option,
    UnknownOptionError,
    callback_options,
    check_name,
    resolve,
)


def test_arguments_beat_environment_beat_json_beat_defaults():
    env = {"PROFSTREAM_RUN_ID": "from-env", "PROFSTREAM_RANK": "4",
           "PROFSTREAM_OPTIONS": json.dumps({"run_id": "from-json", "rank": 9, "device": "npu:1"})}
    opts = resolve(MONITOR_OPTIONS, {"run_id": "from-arg"}, env)
    assert opts["run_id"] == "from-arg"
    assert opts["rank"] == 4  # env over JSON
    assert opts["device"] == "npu:1"  # JSON over default
    assert opts["batch_interval_ms"] == 50.0  # default


def test_none_arguments_count_as_not_given():
    opts = resolve(MONITOR_OPTIONS, {"run_id": None}, {"PROFSTREAM_RUN_ID": "r-env"})
    assert opts["run_id"] == "r-env"


def test_rank_defaults_to_the_launchers_rank_variable():
    assert resolve(MONITOR_OPTIONS, {}, {"RANK": "7"})["rank"] == 7


def test_sizes_accept_units():
    assert resolve(MONITOR_OPTIONS, {"buffer_bytes": "64MiB"}, {})["buffer_bytes"] == 64 * 2**20
    assert resolve(MONITOR_OPTIONS, {}, {"PROFSTREAM_BUFFER_BYTES": "2GB"})["buffer_bytes"] == 2 * 10**9


@pytest.mark.parametrize("args, env, must_say", [
    ({"batch_max_ops": "many"}, {}, "--batch-max-ops"),
    ({}, {"PROFSTREAM_BATCH_MAX_OPS": "0"}, "PROFSTREAM_BATCH_MAX_OPS"),
    ({}, {"PROFSTREAM_OPTIONS": '{"rank": -1}'}, "PROFSTREAM_OPTIONS['rank']"),
    ({}, {"PROFSTREAM_OPTIONS": "{not json"}, "PROFSTREAM_OPTIONS is not valid JSON"),
    ({}, {"PROFSTREAM_OPTIONS": "[1, 2]"}, "must be a JSON object"),
    ({"compression": "brotli"}, {}, "one of lz4"),
    ({"bootstrap": "localhost"}, {}, "host:port"),
    ({"buffer_bytes": "lots"}, {}, "expected a size"),
    ({"enabled": "maybe"}, {}, "expected true or false"),
])
def test_bad_values_get_one_line_errors_naming_their_source(args, env, must_say):
    with pytest.raises(ConfigError) as e:
        resolve(MONITOR_OPTIONS, args, env)
    assert must_say in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_options_are_rejected_with_the_known_ones_listed():
    with pytest.raises(ConfigError, match="unknown option 'run_name'.*run_id"):
        resolve(MONITOR_OPTIONS, {"run_name": "x"}, {})
    with pytest.raises(ConfigError, match="in PROFSTREAM_OPTIONS"):
        resolve(MONITOR_OPTIONS, {}, {"PROFSTREAM_OPTIONS": '{"runid": "x"}'})


@pytest.mark.parametrize("bad", ["../etc", "a/b", "a\\b", "a\nb", "tab\there", "", ".hidden", "x" * 129,
                                 "nul\x00", "sp ace"])
def test_run_ids_that_could_escape_a_directory_or_break_a_label_are_refused(bad):
    with pytest.raises(ConfigError):
        check_name(bad, "run id")
    with pytest.raises(ConfigError):
        resolve(MONITOR_OPTIONS, {"run_id": bad}, {})


@pytest.mark.parametrize("good", ["run-1", "llama.7b_2026-11-21", "job:42@node", "a" * 128])
def test_ordinary_run_ids_are_accepted(good):
    assert resolve(MONITOR_OPTIONS, {"run_id": good}, {})["run_id"] == good


def test_mindformers_profile_options_in_json_set_the_capture_window():
    def window(**profile):
        opts = resolve(MONITOR_OPTIONS, {}, {"PROFSTREAM_OPTIONS": json.dumps(profile)})
        return opts["start_step"], opts["stop_step"]

    assert window(profile=True, profile_start_step=20, profile_stop_step=30) == (20, 30)
    assert window(profile=True) == (1, 10)  # mindformers' defaults
    assert window(profile=True, init_start_profile=True, profile_stop_step=5) == (None, 5)  # from the first step
    assert window(profile=True, profile_memory=True, profile_communication=True, output_path="./prof") == (1, 10)
    assert window(profile=False, profile_start_step=20) == (None, None)  # as in mindformers: profile off
    assert window(profile_start_step=20) == (None, None)


@pytest.mark.parametrize("profile, must_say", [
    ({"profile": "sometimes"}, "PROFSTREAM_OPTIONS['profile']='sometimes': expected true or false"),
    ({"profile": True, "profile_stop_step": -1}, "PROFSTREAM_OPTIONS['profile_stop_step']=-1: expected an integer >= 0"),
    ({"profile": True, "start_step": 3, "profile_start_step": 4}, "both start_step and profile_start_step"),
])
def test_bad_mindformers_profile_options_get_one_line_errors(profile, must_say):
    with pytest.raises(ConfigError) as e:
        resolve(MONITOR_OPTIONS, {}, {"PROFSTREAM_OPTIONS": json.dumps(profile)})
    assert must_say in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_name_beside_the_profile_options_lists_both():
    with pytest.raises(UnknownOptionError, match="unknown option 'profile_start' in PROFSTREAM_OPTIONS \\(did you "
                                                 "mean 'profile_start_step'\\?\\); known options: bootstrap.*profile "
                                                 "options: profile, profile_start_step"):
        resolve(MONITOR_OPTIONS, {}, {"PROFSTREAM_OPTIONS": '{"profile": true, "profile_start": 3}'})


@pytest.mark.parametrize("given, where", [
    ({"evry_n_steps": 10}, {}),  # an argument
    ({}, {"PROFSTREAM_OPTIONS": '{"evry_n_steps": 10}'}),
])
def test_an_unknown_option_names_the_closest_known_one(given, where):
    with pytest.raises(UnknownOptionError) as e:
        resolve(MONITOR_OPTIONS, given, where)
    assert "unknown option 'evry_n_steps'" in str(e.value) and "(did you mean 'every_n_steps'?)" in str(e.value)
    with pytest.raises(UnknownOptionError) as e:
        resolve(MONITOR_OPTIONS, {"zzz": 1}, {})
    assert "did you mean" not in str(e.value)  # nothing close: no guess


def test_a_bad_monitor_argument_is_named_as_the_argument_not_the_command_line_flag():
    from profstream import Monitor

    with pytest.raises(ConfigError) as e:
        Monitor(run_id="a/b", enabled=False)
    assert str(e.value).startswith("argument run_id='a/b': expected") and "--run-id" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        resolve(MONITOR_OPTIONS, {"run_id": "a/b"}, {})  # the command line's: `profstream run --run-id a/b`
    assert str(e.value).startswith("option --run-id='a/b'")


def test_callback_options_take_the_mindformers_profile_section_as_it_is_written():
    section = {"profile": True, "profile_start_step": 3, "profile_stop_step": 6, "init_start_profile": False,
               "profile_communication": True, "profile_memory": True, "output_path": "./output/profile"}
    opts = callback_options({"run_id": "ms-r1", **section}, "ProfstreamCallback", logging.getLogger("t"))
    assert opts == {"run_id": "ms-r1", "start_step": 3, "stop_step": 6}


def test_callback_options_raise_for_an_unknown_name_and_warn_for_a_bad_value(caplog, monkeypatch):
    log = logging.getLogger("profstream.t")
    own = (Option("capture_ops", "bool", True, "capture ops"),)
    with pytest.raises(UnknownOptionError, match="ProfstreamCallback: unknown option 'profile_start' \\(did you mean "
                                                 "'profile_start_step'\\?\\); known options: bootstrap.*capture_ops; "
                                                 "profile options: profile, "):
        callback_options({"profile": True, "profile_start": 3}, "ProfstreamCallback", log, own)
    monkeypatch.setenv("PROFSTREAM_OPTIONS", '{"runid": "x"}')
    with pytest.raises(UnknownOptionError, match="unknown option 'runid' in PROFSTREAM_OPTIONS"):
        callback_options({}, "ProfstreamCallback", log)
    monkeypatch.delenv("PROFSTREAM_OPTIONS")
    with caplog.at_level(logging.WARNING, logger="profstream"):
        assert callback_options({"profile": True, "profile_start_step": 5, "profile_stop_step": 2}, "Cb", log) is None
        assert callback_options({"capture_ops": "sometimes"}, "Cb", log, own) is None
        monkeypatch.setenv("PROFSTREAM_EVERY_N_STEPS", "0")
        assert callback_options({}, "Cb", log) is None
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "Cb is off, training goes on without it: Cb: stop_step 2 < start_step 5: no step would be profiled",
        "Cb is off, training goes on without it: argument capture_ops='sometimes': expected true or false",
        "Cb is off, training goes on without it: PROFSTREAM_EVERY_N_STEPS=0: expected an integer >= 1",
    ]

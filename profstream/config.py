"""Options: one table, one place for names, defaults, checks and documentation.

Every option can be given, in this order of precedence:

1. as an argument (``Monitor(run_id="r1")``, ``--run-id r1`` on the command line);
2. as an environment variable ``PROFSTREAM_<NAME>`` (``PROFSTREAM_RUN_ID=r1``);
3. in the JSON object of ``PROFSTREAM_OPTIONS`` (``{"run_id": "r1"}``);
4. else its default.

A bad value raises ``ConfigError`` whose message is one line naming the option, where it
came from and what is expected.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from profstream.schema.names import NAME_RULE, is_valid_name


class ConfigError(ValueError):
    """A bad option value; the message is one line that says what to fix."""


class UnknownOptionError(ConfigError):
    """An option name no table knows; the message names it and the valid ones."""


def check_name(value: str, what: str = "name") -> str:
    """Validate a user-given name (run id, host, queue name...) that later becomes a file
    name, a Kafka key and a metric label: 1-128 characters of letters, digits and
    ``. _ : = + @ -``, starting with a letter or digit (so no path separators, no ``..``,
    no control characters)."""
    if not is_valid_name(value):
        raise ConfigError(f"invalid {what} {value!r}: use {NAME_RULE}")
    return value


def _parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


_SIZE_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3,
               "kib": 1024, "mib": 1024**2, "gib": 1024**3, "k": 1024, "m": 1024**2, "g": 1024**3}


def _parse_size(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(v))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError("expected a size such as 67108864, 64MiB or 500MB")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _parse_int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError("expected an integer")
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return int(str(v).strip())


def _parse_float(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError("expected a number")
    return float(v)


def parse_properties(value: Any) -> dict[str, str]:
    """The overrides option: a mapping, a JSON object, or ``key=value`` pairs separated by
    newlines or commas. ValueError (without the value: it may hold a secret) when not."""
    if isinstance(value, Mapping):
        return {str(k).strip(): "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        pairs = value
    else:
        text = str(value).strip()
        if text.startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                raise ValueError("expected a JSON object of Kafka client properties") from None
            if not isinstance(data, dict):
                raise ValueError("expected a JSON object of Kafka client properties")
            return parse_properties(data)
        pairs = [p for p in re.split(r"[\n,]", text) if p.strip()]
    out = {}
    for pair in pairs:
        key, sep, val = str(pair).partition("=")
        if not sep or not key.strip():
            raise ValueError("expected KEY=VALUE pairs such as security.protocol=SASL_SSL (or a JSON object)")
        out[key.strip()] = val.strip()
    return out


PARSERS: dict[str, Callable[[Any], Any]] = {
    "str": str, "int": _parse_int, "float": _parse_float, "bool": _parse_bool, "size": _parse_size,
    "properties": parse_properties,
}


@dataclass(frozen=True)
class Option:
    name: str
    kind: str  # key of PARSERS
    default: Any  # a value, or a callable of the environment mapping giving one
    doc: str
    check: Callable[[Any], bool] | None = None
    expect: str = ""  # what check wants, for the error message
    optional: bool = False  # None is a valid value
    secret: bool = False  # may hold a secret: errors never show the value

    @property
    def env(self) -> str:
        return "PROFSTREAM_" + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _default_rank(environ: Mapping[str, str]) -> int:
    for var in ("RANK", "RANK_ID", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if environ.get(var, "").isdigit():
            return int(environ[var])
    return 0


def _default_world_size(environ: Mapping[str, str]) -> int | None:
    for var in ("WORLD_SIZE", "RANK_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        if environ.get(var, "").isdigit() and int(environ[var]) > 0:
            return int(environ[var])
    return None


def _default_host(_environ: Mapping[str, str]) -> str:
    return socket.gethostname()


def _default_run_id(_environ: Mapping[str, str]) -> str:
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
    return f"run-{host}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def _positive(v) -> bool:
    return v > 0


def _non_negative(v) -> bool:
    return v >= 0


COMPRESSIONS = ("lz4", "gzip", "zstd", "snappy", "none")

# Options of the device-side Monitor (and of `profstream simulate`, which drives Monitors).
MONITOR_OPTIONS: tuple[Option, ...] = (
    Option("bootstrap", "str", "127.0.0.1:9092", "Kafka bootstrap servers, host:port[,host:port...]",
           lambda v: all(re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", p.strip()) for p in v.split(",")),
           "host:port[,host:port]"),
    Option("kafka_config", "str", None,
           "file of Kafka client properties with their standard names (security.protocol, sasl.mechanism, "
           "sasl.username, sasl.password, ssl.ca.location, ssl.certificate.location, ssl.key.location...), like "
           "kcat -F or --command-config; a value may be ${env:NAME} or ${file:PATH} (docs/security.md)",
           optional=True),
    Option("kafka_properties", "properties", None,
           "Kafka client properties over those of kafka_config: KEY=VALUE pairs (comma or newline separated) or "
           "a JSON object; -X KEY=VALUE on the command line", optional=True, secret=True),
    Option("run_id", "str", _default_run_id, "run identifier, shared by all ranks of one run",
           is_valid_name, "1-128 letters, digits or . _ : = + @ - (no '/')"),
    Option("rank", "int", _default_rank, "rank of this process (default: $RANK, $RANK_ID or 0)",
           _non_negative, "an integer >= 0"),
    Option("world_size", "int", _default_world_size,
           "ranks in the run, so processors know when a step is complete across ranks "
           "(default: $WORLD_SIZE, $RANK_SIZE or unknown)", _positive, "an integer >= 1", optional=True),
    Option("host", "str", _default_host, "host name reported with every batch",
           is_valid_name, "1-128 letters, digits or . _ : = + @ -"),
    Option("device", "str", "cpu", "device of this rank, e.g. cuda:0, npu:3, cpu",
           is_valid_name, "a device name such as cuda:0"),
    Option("topic_prefix", "str", "profstream", "prefix of the topic names (<prefix>.raw ...)",
           lambda v: bool(re.fullmatch(r"[A-Za-z0-9._-]{1,100}", v)), "1-100 letters, digits or . _ -"),
    Option("batch_max_ops", "int", 8192, "most op events in one batch message",
           lambda v: 1 <= v <= 20000, "1..20000 (a batch must stay under Kafka's 1 MB message limit)"),
    Option("batch_interval_ms", "float", 50.0, "shortest time between two messages: a step's events leave at most this long after it ends",
           lambda v: 1 <= v <= 60000, "1..60000"),
    Option("buffer_bytes", "size", 64 * 1024**2,
           "memory bound of events waiting to be sent; when full, ops are dropped first and counted",
           lambda v: v >= 1024**2, "at least 1MiB"),
    Option("start_step", "int", None, "first step whose ops are captured (inclusive)", _non_negative,
           "an integer >= 0", optional=True),
    Option("stop_step", "int", None, "last step whose ops are captured (inclusive)", _non_negative,
           "an integer >= 0", optional=True),
    Option("every_n_steps", "int", None, "capture ops only on every n-th step from start_step",
           _positive, "an integer >= 1", optional=True),
    Option("collective_bytes", "bool", False,
           "record tensor shapes in captured steps so that collectives carry their message size (bandwidth "
           "figures); torch.profiler's record_shapes, a cost on every captured op"),
    Option("scheduled_capture", "bool", True,
           "capture ops on the steps of start_step / stop_step / every_n_steps (false: only on the steps "
           "capture requests ask for)"),
    Option("control", "bool", True,
           "read capture requests for this run from <topic_prefix>.control (a thread with its own Kafka "
           "consumer; docs/capture.md)"),
    Option("progress_interval_s", "float", 5.0,
           "seconds between two RankProgress records (the step this rank is in and since when), sent by the "
           "control thread to the raw topic, inside long steps too: the processors tell a hang from them "
           "(docs/figures.md, Hangs; needs control; 0: off)",
           lambda v: v == 0 or 0.5 <= v <= 3600, "0 (off) or 0.5..3600"),
    Option("capture_max_steps", "int", 100, "most steps one capture request may capture (more is refused)",
           _positive, "an integer >= 1"),
    Option("compression", "str", "lz4", "Kafka compression codec", lambda v: v in COMPRESSIONS,
           "one of " + ", ".join(COMPRESSIONS)),
    Option("host_sample_interval_s", "float", 1.0,
           "seconds between host CPU/RSS readings, and the PyTorch producer's readings of its DataLoader workers "
           "(0: off)",
           _non_negative, "a number >= 0"),
    Option("device_interval_ms", "float", 500.0,
           "milliseconds between device counter readings (NVML on cuda devices; 0: off)",
           lambda v: v == 0 or 10 <= v <= 3_600_000, "0 (off) or 10..3600000"),
    Option("counter_devices", "str", None,
           "ordinals of the devices whose counters are read, e.g. 0,1 (default: the device option's)",
           lambda v: bool(re.fullmatch(r"\d{1,4}(,\d{1,4}){0,63}", v)), "ordinals such as 0 or 0,1,2,3",
           optional=True),
    Option("peak_tflops", "float", None,
           "dense peak TFLOPS of one of this rank's devices for the training's compute dtype, the denominator "
           "of MFU (default: profstream's table, for the device and dtype the torch producer sees or "
           "compute_dtype names; docs/figures.md)", _positive, "a number > 0", optional=True),
    Option("compute_dtype", "str", None,
           "dtype the model's matrix multiplications run in (bf16, fp16, fp32, tf32, fp8), to look the "
           "device's peak up (default: what the torch producer's FLOP count sees)",
           lambda v: v in ("bf16", "fp16", "fp32", "tf32", "fp8"), "bf16, fp16, fp32, tf32 or fp8", optional=True),
    Option("flops_per_token", "float", None,
           "model FLOPs of one trained token (forward and backward, e.g. 6 x parameters): a step's FLOPs are "
           "this x its tokens, given (default: counted by the torch producer)", _positive, "a number > 0",
           optional=True),
    Option("auto_watermark", "bool", True,
           "advance the watermark at each step end (turn off when ops of a step arrive after it ends)"),
    Option("spool_dir", "str", None,
           "directory of the disk spool: batches Kafka cannot take (an outage) are written there and sent "
           "in order when it is back (default: none, the memory buffer alone; docs/monitor.md)", optional=True),
    Option("spool_max_bytes", "size", 1024**3, "most disk the spool of one rank may use; when full, new events "
           "wait in the memory buffer (and drop from there, counted)", lambda v: v >= 16 * 1024**2,
           "at least 16MiB"),
    Option("record_only", "bool", False,
           "connect to no broker: every batch goes to the spool, for `profstream spool publish` later "
           "(needs spool_dir; no capture requests)"),
    Option("connect_timeout_s", "float", 10.0, "seconds one attempt to reach the broker may take (the first failure logs one warning)",
           _positive, "a number > 0"),
    Option("enabled", "bool", True, "false turns every Monitor call into a no-op"),
    Option("native", "bool", True,
           "record, encode and send in the compiled extension when it loads (false: the pure-Python Monitor, "
           "whose sender thread holds the GIL for its per-batch work)"),
)


def check_monitor_options(opts: Mapping[str, Any]) -> None:
    """What one option cannot say alone: ConfigError for a combination that cannot work."""
    if opts.get("record_only") and not opts.get("spool_dir"):
        raise ConfigError("record_only needs spool_dir: give the directory the batches are written to "
                          "(--spool-dir, PROFSTREAM_SPOOL_DIR)")


def _env_options(environ: Mapping[str, str]) -> dict:
    raw = environ.get("PROFSTREAM_OPTIONS")
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"PROFSTREAM_OPTIONS is not valid JSON ({e.msg} at char {e.pos}): give a JSON object") from None
    if not isinstance(data, dict):
        raise ConfigError("PROFSTREAM_OPTIONS must be a JSON object such as {\"run_id\": \"r1\"}")
    return from_profile_options(data, "PROFSTREAM_OPTIONS")


def option_given(name: str, args: Mapping[str, Any], environ: Mapping[str, str]) -> bool:
    """Whether option ``name`` is set by an argument, its PROFSTREAM_* variable or
    PROFSTREAM_OPTIONS (rather than left to its default)."""
    return (args.get(name) is not None or f"PROFSTREAM_{name.upper()}" in environ
            or name in _env_options(environ))


# The profile options mindformers configs (and MindSpore's Profiler) spell their own way.
# They map onto the op capture window (start_step / stop_step) in PROFSTREAM_OPTIONS and in
# the MindSpore callback's arguments; as in mindformers, they apply only with profile true.
# The rest are accepted and have no equivalent here (docs/mindspore.md says why).
PROFILE_WINDOW = ("profile", "profile_start_step", "profile_stop_step", "init_start_profile")
PROFILE_NO_EQUIVALENT = ("profile_memory", "profile_communication", "output_path", "profile_rank_ids",
                         "profile_pipeline", "profiler_level", "with_stack", "data_simplification", "mstx")
PROFILE_OPTIONS = PROFILE_WINDOW + PROFILE_NO_EQUIVALENT
PROFILE_DEFAULT_WINDOW = (1, 10)  # mindformers' profile_start_step, profile_stop_step


def from_profile_options(options: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``options`` with the mindformers-style profile options replaced by start_step /
    stop_step: with ``profile`` true, profile_start_step (default 1; none with
    init_start_profile true) .. profile_stop_step (default 10); with it false or absent they
    are ignored. ConfigError when a value is bad or a step is given both ways."""
    if not any(name in options for name in PROFILE_OPTIONS):
        return dict(options)
    out = {k: v for k, v in options.items() if k not in PROFILE_OPTIONS}

    def parsed(name: str, parse: Callable[[Any], Any], default: Any) -> Any:
        if name not in options:
            return default
        try:
            value = parse(options[name])
        except (TypeError, ValueError):
            value = None
        if value is None or (parse is _parse_int and value < 0):
            expect = "an integer >= 0" if parse is _parse_int else "true or false"
            raise ConfigError(f"{source}[{name!r}]={options[name]!r}: expected {expect}")
        return value

    if not parsed("profile", _parse_bool, False):
        return out
    start = None if parsed("init_start_profile", _parse_bool, False) else parsed(
        "profile_start_step", _parse_int, PROFILE_DEFAULT_WINDOW[0])
    window = {"start_step": start, "stop_step": parsed("profile_stop_step", _parse_int, PROFILE_DEFAULT_WINDOW[1])}
    for ours, theirs in (("start_step", "profile_start_step"), ("stop_step", "profile_stop_step")):
        if out.get(ours) is not None and theirs in options:
            raise ConfigError(f"{source} gives both {ours} and {theirs}: keep one")
        if out.get(ours) is None:
            out[ours] = window[ours]
    return out


def callback_options(options: Mapping[str, Any], source: str, log: logging.Logger,
                     extra: tuple[Option, ...] = ()) -> dict[str, Any] | None:
    """A framework callback's keyword options, checked at start-up: Monitor options (the
    profile options translated by ``from_profile_options``) and ``extra``, the callback's
    own (read from arguments and PROFSTREAM_<NAME> only). An unknown name, given or in
    PROFSTREAM_OPTIONS, raises UnknownOptionError naming the valid ones; a bad value, here
    or in PROFSTREAM_*, or a stop_step before the start_step logs one warning on ``log``
    and gives None: the callback stays off and training goes on."""
    own = [o.name for o in extra]
    known = [o.name for o in MONITOR_OPTIONS] + own
    for name in options:
        if name not in known and name not in PROFILE_OPTIONS:
            raise unknown_option(name, known, profile=True, prefix=f"{source}: ")
    given_own = {k: v for k, v in options.items() if k in own}
    try:
        out = from_profile_options({k: v for k, v in options.items() if k not in own}, source)
        window = resolve(MONITOR_OPTIONS, out, keywords=True)
        resolve(extra, given_own, {k: v for k, v in os.environ.items() if k != "PROFSTREAM_OPTIONS"}, keywords=True)
        start, stop = window["start_step"], window["stop_step"]
        if start is not None and stop is not None and stop < start:
            raise ConfigError(f"{source}: stop_step {stop} < start_step {start}: no step would be profiled")
    except UnknownOptionError:
        raise
    except ConfigError as e:
        log.warning("profstream: %s is off, training goes on without it: %s", source, e)
        return None
    return {**out, **given_own}


def unknown_option(name: str, known: list[str], where: str = "", profile: bool = False,
                   prefix: str = "") -> UnknownOptionError:
    """The one-line error for option ``name`` (given ``where``), naming the closest known one."""
    import difflib

    close = difflib.get_close_matches(name, known + list(PROFILE_OPTIONS if profile else ()), n=1, cutoff=0.6)
    return UnknownOptionError(
        f"{prefix}unknown option {name!r}{where}" + (f" (did you mean {close[0]!r}?)" if close else "")
        + f"; known options: {', '.join(known)}" + (f"; profile options: {', '.join(PROFILE_OPTIONS)}" if profile else ""))


def resolve(table: tuple[Option, ...], args: Mapping[str, Any] | None = None,
            environ: Mapping[str, str] | None = None, keywords: bool = False) -> dict[str, Any]:
    """Options of ``table`` from arguments, PROFSTREAM_* variables, PROFSTREAM_OPTIONS, defaults.

    Arguments whose value is None count as not given. ``keywords``: the arguments are a
    function's keyword arguments (``Monitor(run_id=...)``), named so in errors, else the
    command line's options (``--run-id``)."""
    environ = os.environ if environ is None else environ
    args = {k: v for k, v in (args or {}).items() if v is not None}
    known = {o.name: o for o in table}
    for name in args:
        if name not in known:
            raise unknown_option(name, list(known))
    from_json = _env_options(environ)
    for name in from_json:
        if name not in known:
            raise unknown_option(name, list(known), " in PROFSTREAM_OPTIONS", profile=True)
    out = {}
    for opt in table:
        if opt.name in args:
            value, source = args[opt.name], (f"argument {opt.name}" if keywords else f"option {opt.flag}")
        elif opt.env in environ:
            value, source = environ[opt.env], opt.env
        elif opt.name in from_json:
            value, source = from_json[opt.name], f"PROFSTREAM_OPTIONS[{opt.name!r}]"
        else:
            value = opt.default(environ) if callable(opt.default) else opt.default
            source = f"default of {opt.name}"
        if value is None or (opt.optional and value == ""):
            if not opt.optional:
                raise ConfigError(f"{source} needs a value")
            out[opt.name] = None
            continue
        shown = "" if opt.secret else f"={value!r}"  # a secret's value is never in an error
        try:
            value = PARSERS[opt.kind](value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}{shown}: {e if str(e).startswith('expected') else 'expected ' + opt.kind}") from None
        if opt.check is not None and not opt.check(value):
            raise ConfigError(f"{source}{'' if opt.secret else f'={value!r}'}: expected {opt.expect}")
        out[opt.name] = value
    return out


def describe(table: tuple[Option, ...]) -> str:
    """The options table as text (used in docs and --help)."""
    rows = []
    for o in table:
        default = "(computed)" if callable(o.default) else repr(o.default)
        rows.append(f"{o.name:24} {o.env:34} default {default}: {o.doc}")
    return "\n".join(rows)

"""Configuration: one strict dataclass per component, and one mapping onto CLI, TOML and environment.

Every option is a field of exactly one component dataclass; its default,
type and help live there and nowhere else. Precedence: defaults < TOML file
(`--config`) < `ISLANDS_*` environment variables < command line. Option names
are flat and unique across components (`--window`, TOML `window = 20`,
`ISLANDS_WINDOW=20`); unknown keys are an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from islands.models.data import TOKENS_PREFIX, DataConfig
from islands.models.transformer import MODEL_SIZES, ModelConfig, model_config
from islands.protocols.admission import SwarmKeyError, load_swarm_key
from islands.protocols.contact import parse_contact
from islands.protocols.diloco import DiLoCoConfig
from islands.protocols.records import P2P_ADDRESS, parse_address

ENV_PREFIX = "ISLANDS_"


def _opt(default: Any, help: str, **extra: Any) -> Any:
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help, **extra})
    return dataclasses.field(default=default, metadata={"help": help, **extra})


InnerOpt = Literal["adamw", "shampoo"]
Role = Literal["island", "satellite"]
ProgressMode = Literal["auto", "bar", "lines", "off"]
Parallel = Literal["ddp", "fsdp"]

DEFAULT_LR = {"adamw": 3e-3, "shampoo": 3e-3}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = _opt("tiny", f"model size: {', '.join(MODEL_SIZES)}")
    dense: bool = _opt(False, "dense feed-forward layers instead of 32 experts with top-1 routing")
    steps: int = _opt(1000, "train until this inner step (a resumed run continues up to it)")
    batch_size: int = _opt(8, "sequences per inner step")
    seq_len: int = _opt(128, "bytes (or tokens) per sequence")
    vocab_size: int | None = _opt(None, "the model's vocabulary: bytes (256) by default; token data (--data tokens:GLOB) needs its tokenizer's size", metavar="V")
    inner_opt: InnerOpt = _opt("adamw", "inner optimizer: adamw, or shampoo (pytorch-optimizer's ScalableShampoo)")
    lr: float | None = _opt(None, "inner learning rate (default 3e-3)")
    warmup_steps: int = _opt(20, "linear learning-rate warm-up, in inner steps")
    weight_decay: float = _opt(0.01, "inner decoupled weight decay")
    grad_clip: float = _opt(1.0, "clip the gradient norm to this (0 disables)")
    eval_every: int = _opt(0, "evaluate on held-out data every N steps (0: at the end only)")
    torch_threads: int = _opt(1, "torch intra-op CPU threads (0: torch's default); on CPU, one thread per island is fastest here unless the model is large")
    nproc: int = _opt(
        1, "ranks of this island: data-parallel processes (gloo on CPU, NCCL on GPU), each with --batch-size "
        "sequences a step; rank 0 is the island's member of the swarm (under torchrun, its WORLD_SIZE rules)", metavar="N",
    )
    parallel: Parallel = _opt(
        "ddp", "how the ranks of a multi-rank island share the model: ddp (each holds all of it), or fsdp (FSDP2: "
        "each holds 1/N of the parameters, gradients and inner optimizer state; adamw only; the inner optimizer's "
        "state is not checkpointed)",
    )
    device: str = _opt("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N; on cuda, bf16 autocast")
    balance: bool = _opt(
        False, "every window, set gradient accumulation (micro-batches of --batch-size per step, up to 16) so that "
        "this island's step takes about as long as the other islands' median step; logged as `balance` events",
    )

    def __post_init__(self):
        if self.model not in MODEL_SIZES:
            raise ValueError(f"model must be one of {', '.join(MODEL_SIZES)}, got {self.model!r}")
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {self.nproc}")
        if self.parallel == "fsdp" and self.inner_opt != "adamw":
            raise ValueError(f"parallel fsdp works with inner_opt adamw only (shampoo's preconditioners need whole tensors), got {self.inner_opt!r}")
        if self.device not in ("auto", "cpu", "cuda") and not (self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("warmup_steps", "eval_every", "torch_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("weight_decay and grad_clip must be >= 0")

    @property
    def learning_rate(self) -> float:
        return DEFAULT_LR[self.inner_opt] if self.lr is None else self.lr

    def model_config(self) -> ModelConfig:
        return model_config(self.model, dense=self.dense, vocab_size=self.vocab_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NetConfig:
    join: list[str] = _opt([], "multiaddress of a peer of the swarm to join (repeatable); none starts a new swarm", metavar="MADDR")
    run_id: str = _opt("islands", "the run's name in the DHT; every island of a run uses the same")
    listen: list[str] = _opt(["/ip4/0.0.0.0/tcp/0"], "multiaddress to listen on (repeatable)", metavar="MADDR")
    announce: list[str] = _opt([], "multiaddress others should dial, e.g. a relay in front of this node (repeatable)", metavar="MADDR")
    identity: str | None = _opt(None, "file holding this node's private key, created if missing (keeps the peer id across restarts)", metavar="PATH")
    role: Role = _opt("island", "island, or satellite (in contact only at times, see --contact)")
    contact: str | None = _opt(
        None, "a satellite's contact windows from its start: 'up 20s every 60s [after 10s]', '0-20,60-80' or 'always'",
        metavar="SPEC",
    )
    swarm_key: str | None = _opt(
        None, "file with the shared secret that admits a peer to the swarm (every island of the run uses the same; "
        "make one with: islands-node keygen PATH)", metavar="PATH",
    )
    data_listen: str = _opt("0.0.0.0:0", "HOST:PORT the round transport listens on (port 0: any free one)", metavar="HOST:PORT")
    data_announce: str | None = _opt(
        None, "HOST:PORT the other islands dial for rounds (default: the listen port at this "
        "node's first announced or visible IPv4 address), or p2p for an island that cannot be dialled (behind NAT): "
        "the others then reach its rounds over libp2p streams, and it listens on no port of its own", metavar="HOST:PORT|p2p",
    )
    metrics_port: int | None = _opt(None, "serve Prometheus metrics at http://METRICS_HOST:N/metrics (0: any free port, logged)", metavar="N")
    metrics_host: str = _opt("127.0.0.1", "address the metrics endpoint listens on (0.0.0.0 for a remote Prometheus)", metavar="ADDR")
    wait_islands: int = _opt(1, "before step 1, wait until this many islands are in the swarm (see --wait-timeout-s); not once another island has trained: the run is under way", metavar="N")
    wait_timeout_s: float = _opt(120.0, "give up waiting for --wait-islands after this long and train anyway", metavar="S")
    match_wait_s: float = _opt(5.0, "how long a round waits for the other islands before it runs with whoever came", metavar="S")
    leave_timeout_s: float = _opt(10.0, "on SIGINT/SIGTERM, rounds in flight get this long in all to finish, then are abandoned", metavar="S")
    end_wait_s: float = _opt(
        120.0, "at the end of the run, wait this long at most for the other islands to finish their steps, "
        "then agree the model with those that have", metavar="S",
    )

    def __post_init__(self):
        if not self.run_id or any(c.isspace() or c == ":" for c in self.run_id):
            raise ValueError(f"run_id must be a non-empty name without spaces or ':', got {self.run_id!r}")
        if self.role not in typing.get_args(Role):
            raise ValueError(f"role must be island or satellite, got {self.role!r}")
        for name in ("join", "listen", "announce"):
            for maddr in getattr(self, name):
                if not maddr.startswith("/"):
                    raise ValueError(f"{name} {maddr!r} is not a multiaddress (like /ip4/127.0.0.1/tcp/4000/p2p/Qm...)")
        if self.wait_islands < 1:
            raise ValueError(f"wait_islands must be >= 1, got {self.wait_islands}")
        if self.wait_timeout_s < 0 or self.match_wait_s <= 0 or self.leave_timeout_s < 0 or self.end_wait_s < 0:
            raise ValueError("wait_timeout_s, leave_timeout_s and end_wait_s must be >= 0, match_wait_s > 0")
        if self.contact is not None:
            parse_contact(self.contact)  # ValueError names the spec and the accepted forms
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        for name in ("data_listen", "data_announce"):
            value = getattr(self, name)
            if name == "data_announce" and value == P2P_ADDRESS:
                continue
            try:
                _, port = parse_address(value or "x:1")  # data_announce may be unset
                ok = port > 0 or name == "data_listen"  # listening on port 0 takes any free one
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{name} must be HOST:PORT{' or p2p' if name == 'data_announce' else ''}, got {value!r}")
        if self.swarm_key is not None:
            try:
                load_swarm_key(self.swarm_key)
            except SwarmKeyError as e:
                raise ValueError(f"swarm_key: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputConfig:
    run_dir: str = _opt("islands-run", "folder for checkpoints and logs; an existing checkpoint there is resumed", metavar="DIR")
    log_json: str | None = _opt(None, "event log, one JSON object a line (default: RUN_DIR/events.jsonl)", metavar="PATH")
    maddr_file: str | None = _opt(None, "write this node's multiaddresses here once it listens", metavar="PATH")
    checkpoint_every: int | None = _opt(None, "checkpoint every N steps (default: once a window)", metavar="N")
    progress: ProgressMode = _opt("auto", "auto (a live line on a terminal, log lines otherwise), bar, lines or off")

    def __post_init__(self):
        if not self.run_dir:
            raise ValueError("run_dir must not be empty")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.progress not in typing.get_args(ProgressMode):
            raise ValueError(f"progress must be auto, bar, lines or off, got {self.progress!r}")

    @property
    def event_log_path(self) -> Path:
        return Path(self.log_json) if self.log_json else Path(self.run_dir) / "events.jsonl"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    task: str | None = _opt(
        None, "train your own model: MODULE:FUNCTION, a function that takes a TaskContext and returns a Task "
        "(README, \"Tasks\"); called on every rank; without it the built-in model trains (--model, --data)",
        metavar="MODULE:FUNCTION",
    )
    task_arg: list[str] = _opt([], "an argument for the task, KEY=VALUE (repeatable; TOML: a [task.args] table)", metavar="KEY=VALUE")

    def __post_init__(self):
        if self.task is not None:
            from .task import ENTRY

            if not ENTRY.match(self.task):
                raise ValueError(f"task {self.task!r}: expected MODULE:FUNCTION, like mypkg.train:build")
        self.args  # noqa: B018 - checks every KEY=VALUE

    @property
    def args(self) -> dict[str, str]:
        from .task import parse_args

        return parse_args(self.task_arg)


SECTIONS: dict[str, type] = {
    "task": TaskConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "diloco": DiLoCoConfig,
    "net": NetConfig,
    "output": OutputConfig,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    diloco: DiLoCoConfig = dataclasses.field(default_factory=DiLoCoConfig)
    net: NetConfig = dataclasses.field(default_factory=NetConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)

    def __post_init__(self):
        if self.task.task is not None:
            if self.train.balance:
                raise ValueError("balance sets the built-in loop's micro-batches; a task (--task) takes its own steps")
            self._check_roles()
            return
        model = self.train.model_config()
        if self.diloco.fragments > model.n_layer:
            raise ValueError(
                f"fragments {self.diloco.fragments} exceeds the {model.n_layer} blocks of model "
                f"{self.train.model!r}: use --fragments {model.n_layer} or fewer"
            )
        if self.train.seq_len > model.max_seq_len:
            raise ValueError(f"seq_len {self.train.seq_len} exceeds the model's max_seq_len {model.max_seq_len}")
        tokens = self.data.data.startswith(TOKENS_PREFIX)
        if tokens and self.train.vocab_size is None:
            raise ValueError("token data needs the tokenizer's vocabulary: give --vocab-size")
        if not tokens and self.train.vocab_size not in (None, 256):
            raise ValueError(f"vocab_size {self.train.vocab_size} applies to token data (--data tokens:GLOB); bytes have 256")
        self._check_roles()

    def _check_roles(self) -> None:
        if self.net.role == "satellite" and not self.net.contact:
            raise ValueError("a satellite needs --contact, e.g. 'up 20s every 60s'")
        if self.net.contact is not None and self.net.role != "satellite":
            raise ValueError("contact applies to satellites only: add --role satellite")

    def flat(self) -> dict[str, Any]:
        """Every option by its flat name, as the event log's `config` shows it."""
        return {f.name: getattr(getattr(self, s), f.name) for s, f in _all_fields()}


# --- the mapping -------------------------------------------------------------


def _all_fields() -> list[tuple[str, dataclasses.Field]]:
    return [(section, f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


@dataclasses.dataclass(frozen=True)
class Option:
    section: str
    name: str
    type: Any
    default: Any
    help: str
    metavar: str | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def base(self) -> Any:
        """The type without `| None`."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        if typing.get_origin(self.type) in (typing.Union, types.UnionType) and len(args) == 1:
            return args[0]
        return self.type

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.type)

    @property
    def is_list(self) -> bool:
        return typing.get_origin(self.base) is list

    @property
    def choices(self) -> tuple | None:
        return typing.get_args(self.base) if typing.get_origin(self.base) is Literal else None


def options() -> dict[str, Option]:
    out: dict[str, Option] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in out:
                raise RuntimeError(f"option {f.name!r} is defined by two components")
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out[f.name] = Option(section, f.name, hints[f.name], default, f.metadata.get("help", ""), f.metadata.get("metavar"))
    return out


class ConfigError(ValueError):
    """A bad option value, file or combination; the message names the option."""


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def coerce(opt: Option, value: Any, source: str) -> Any:
    """`value` (a string from the CLI or environment, or a TOML value) as the option's type."""
    where = f"{source} {opt.name}"
    if value is None or (isinstance(value, str) and opt.optional and value.lower() in ("", "none")):
        if opt.optional:
            return None
        raise ConfigError(f"{where}: a value is required")
    base = opt.base
    if opt.is_list:
        items = value if isinstance(value, list) else [v for v in str(value).replace(",", " ").split() if v]
        if not all(isinstance(v, str) for v in items):
            raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
        return list(items)
    if opt.choices is not None:
        if value not in opt.choices:
            raise ConfigError(f"{where}: expected one of {', '.join(map(str, opt.choices))}, got {value!r}")
        return value
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if base is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            return int(str(value), 0)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if base is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return float(str(value))
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if base is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise AssertionError(f"unhandled option type {opt.type!r}")


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    known = options()
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "task" and isinstance(value, dict):  # [task] entry = "..." and a [task.args] table
            values.update(_task_table(value, path))
            continue
        # [section] tables are accepted too, as long as each key sits in its own component
        if isinstance(value, dict) and key in SECTIONS:
            for sub, v in value.items():
                opt = known.get(sub)
                if opt is None or opt.section != key:
                    raise ConfigError(f"config file {str(path)!r}: unknown key {key}.{sub!r}")
                values[sub] = coerce(opt, v, f"config file {str(path)!r}:")
            continue
        if key not in known:
            raise ConfigError(f"config file {str(path)!r}: unknown key {key!r}")
        values[key] = coerce(known[key], value, f"config file {str(path)!r}:")
    return values


def _task_table(table: dict, path: str | os.PathLike) -> dict[str, Any]:
    """TOML `[task]`: `entry` (the --task) and `args` (a table of --task-arg KEY = VALUE)."""
    where = f"config file {str(path)!r}:"
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key in ("entry", "task"):
            out["task"] = coerce(options()["task"], value, where)
        elif key == "args" and isinstance(value, dict):
            out["task_arg"] = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in value.items()]
        elif key in ("task_arg",):
            out["task_arg"] = coerce(options()["task_arg"], value, where)
        else:
            raise ConfigError(f"config file {str(path)!r}: unknown key task.{key!r} (the [task] table takes entry and args)")
    return out


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    known = {opt.env: opt for opt in options().values()}
    values = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key == ENV_PREFIX + "CONFIG":
            continue
        if key not in known:
            raise ConfigError(f"environment variable {key} is not an option of islands-node")
        values[known[key].name] = coerce(known[key], value, f"environment {key}:")
    return values


def add_arguments(parser: argparse.ArgumentParser, sections: Iterable[str] = tuple(SECTIONS)) -> None:
    """One flag per option of these components, grouped by component, with no defaults (so that
    given ones are known)."""
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help="TOML file of options (keys as the long options, with _ for -)")
    groups = {s: parser.add_argument_group(f"{s} options") for s in sections}
    for opt in options().values():
        if opt.section not in groups:
            continue
        group = groups[opt.section]
        shown = f" (default: {opt.default})" if opt.default not in (None, [], "") else ""
        kw: dict[str, Any] = {"dest": opt.name, "default": argparse.SUPPRESS, "help": opt.help + shown}
        if opt.base is bool:
            group.add_argument(opt.flag, action=argparse.BooleanOptionalAction, **kw)
        elif opt.is_list:
            group.add_argument(opt.flag, action="append", metavar=opt.metavar or "VALUE", **kw)
        else:
            group.add_argument(opt.flag, metavar=opt.metavar or (opt.name.upper() if opt.choices is None else None), choices=opt.choices, **kw)


def build_config(cli: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Config:
    """Merge defaults < TOML < environment < CLI into a validated Config; ConfigError on any bad input."""
    environ = os.environ if environ is None else environ
    known = options()
    values: dict[str, Any] = {}
    config_file = cli.get("config") or environ.get(ENV_PREFIX + "CONFIG")
    if config_file:
        values.update(read_toml(config_file))
    values.update(read_env(environ))
    for name, raw in cli.items():
        if name == "config":
            continue
        values[name] = coerce(known[name], raw, "option")
    return config_from_values(values)


def config_from_values(values: Mapping[str, Any]) -> Config:
    known = options()
    by_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, value in values.items():
        by_section[known[name].section][name] = value
    try:
        parts = {s: SECTIONS[s](**kw) for s, kw in by_section.items()}
        return Config(**parts)
    except ValueError as e:
        raise ConfigError(str(e)) from None

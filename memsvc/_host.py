"""``memsvc up --config host.toml``: a host's models in one file, as llama-swap's config and Ollama's
model list are. The file names the models (a checkpoint directory, a Hugging Face Hub id or
``synthetic:<preset>``, each with its served name, device and worker flags), the manager's default
policy and per-model overrides; ``memsvc up`` starts the manager, one worker per model and the OpenAI
gateway, and then:

- loads the models of one device one at a time, each put to sleep (the policy's tier-1 actions) before
  the next one there loads, the last left awake: a device need not hold them all at once, and a
  request wakes the one it wants (a fraction of a second), putting another to sleep if the budget
  needs it;
- restarts a worker that dies (after 1 s, doubling to 30 s while it keeps dying young), and puts it to
  sleep once it has loaded where other models share its device (the manager checks a device's budget
  when a worker wakes, not when one registers);
- on SIGHUP reads the file again: workers of models that are gone stop, new ones start, changed ones
  restart, the others are not touched, and the policy is applied again (a file that does not load is
  logged and changes nothing);
- with ``[workers] stop_after``, stops a worker that has been asleep (unleased, nothing waiting)
  that long, and starts it again (from the standby, where there is one) when an acquire waits for it:
  no process is the deepest sleep level. Its policy's ``start_timeout`` (:data:`START_TIMEOUT_S`
  unless the file sets one) makes the manager hold such an acquire instead of refusing it, and the
  gateway send it;
- on SIGINT or SIGTERM stops them all (gateway, workers, manager) and exits 0;
- stops them all and exits 1 if the manager or the gateway dies.

With ``[manager] address`` the manager runs elsewhere (several hosts, or Kubernetes pods of many
models, deploy/kubernetes/overlays/many-models): none is started here, the file's ``[policy]`` becomes
each of its workers' overrides, and ``[workers]`` places them (ports, advertised host, id prefix).

The policy is applied with UpdatePolicy at every start and reload, so the file wins over what an
earlier run stored. Models on one device share its budget as always: with ``device_budget_bytes``
set so that one fits, they take turns (docs/operations.md, "Turns").
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memsvc._up import MEMSVC, stop_children
from memsvc.errors import InvalidArgument, MemsvcError, NotFound, Unavailable, WrongState
from memsvc.runtime.logs import announce

if TYPE_CHECKING:
    from memsvc.client import ManagerClient

RESTART_S = (1.0, 30.0)
"""A dead worker's restart delay: the first, doubling up to the second while it keeps dying young."""
YOUNG_S = 60.0
"""A worker that ran this long before it died is restarted after the first delay again."""
READY_S = 60.0
"""How long the manager may take to answer after it starts."""
LOAD_S = 900.0
"""How long a model may take to load (a Hub download included) before the next on its device starts anyway."""
TICK_S = 0.2
"""How often the supervision loop looks at the children and the manager."""
ON_DEMAND_TICK_S = 0.05
"""The same while a worker is stopped (``[workers] stop_after``): an acquire waiting for it is seen
within this (one ListWorkers on loopback each time), a small part of the start it waits for."""
START_TIMEOUT_S = 300.0
"""With ``[workers] stop_after``: the policy's ``start_timeout`` where the file sets none, how long an
acquire for a stopped model waits for its process (the gateway's own acquire timeout)."""

_SECTIONS = {"manager", "gateway", "workers", "policy", "models"}
_MANAGER_KEYS = {"listen": "127.0.0.1:50051", "metrics_listen": "127.0.0.1:9400", "state_dir": ".memsvc", "address": ""}
_GATEWAY_KEYS = {"listen": "127.0.0.1:8000", "processes": 1}
_WORKERS_KEYS = {"standby": False, "listen": "127.0.0.1:0", "advertise_host": "", "id_prefix": "", "stop_after": 0.0}
ADVERTISE_HOST_VAR = "MEMSVC_ADVERTISE_HOST"
"""Where ``[workers] advertise_host`` is empty, the host the workers are advertised at (a pod's IP)."""
ID_PREFIX_VAR = "MEMSVC_WORKER_ID_PREFIX"
"""Where ``[workers] id_prefix`` is empty, put before every worker id (a pod's name, so that several
pods of one file register distinct workers with one manager)."""
_MODEL_KEYS = {"model", "name", "id", "device", "backend", "args", "policy"}
_DEFAULT_POLICY = {"idle_sleep_timeout": 300.0, "idle_deep_sleep_timeout": 3600.0}
"""What ``memsvc up`` seeds without a file, under the file's ``[policy]``."""


@dataclass(frozen=True)
class ModelEntry:
    """One ``[[models]]`` entry: one worker."""

    worker_id: str
    """``id``, else made from ``name`` or ``model`` (characters other than letters, digits, ``.``, ``_``
    and ``-`` become ``-``)."""
    model: str
    name: str = ""
    """The served name (``--served-model-name``); empty: the worker's default for the model."""
    device: int = 0
    backend: str = "auto"
    args: tuple[str, ...] = ()
    """More ``memsvc worker`` flags."""
    policy: Mapping[str, Any] = field(default_factory=dict)
    """This worker's policy overrides (the manager's policy fields)."""
    listen: str = "127.0.0.1:0"
    """Its ``--listen``: ``[workers] listen``, its port plus the model's place in the file (0 stays 0)."""
    advertise: str = ""
    """Its ``--advertise`` (``[workers] advertise_host`` and its port), or "" for its listen address."""

    def flags(self, manager: str) -> list[str]:
        """Its ``memsvc worker`` flags: a new process's command line, or a standby's hand-off."""
        out = [
            "--listen",
            self.listen,
            "--manager",
            manager,
            "--worker-id",
            self.worker_id,
            "--model",
            self.model,
            "--device",
            str(self.device),
            "--backend",
            self.backend,
        ]
        if self.advertise:
            out += ["--advertise", self.advertise]
        if self.name:
            out += ["--served-model-name", self.name]
        return out + list(self.args)


@dataclass(frozen=True)
class HostConfig:
    manager_listen: str = _MANAGER_KEYS["listen"]
    metrics_listen: str = _MANAGER_KEYS["metrics_listen"]
    state_dir: str = _MANAGER_KEYS["state_dir"]
    gateway_listen: str = str(_GATEWAY_KEYS["listen"])
    gateway_processes: int = 1
    policy: Mapping[str, Any] = field(default_factory=dict)
    """The manager's default policy fields (memsvc/manager/policy.py), ``memsvc up``'s idle timers under them."""
    models: tuple[ModelEntry, ...] = ()
    standby: bool = False
    """Keep a standby worker process per device (worker/standby.py) for the next start there."""
    manager_address: str = ""
    """``[manager] address``: a manager that runs elsewhere (several hosts, a Kubernetes pod of many
    models): no manager is started here, its default policy is left alone, and ``[policy]`` applies
    to this file's workers as their overrides."""
    stop_after: float = 0.0
    """``[workers] stop_after``: seconds a worker stays asleep before its process is stopped (started
    again when an acquire waits for it); 0 = never."""

    @property
    def manager(self) -> str:
        """The address workers, the gateway and ``memsvc up`` itself dial the manager at."""
        return self.manager_address or self.manager_listen


def _worker_id(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", text).strip("-")[:128] or "model"


def _policy(raw: object, where: str) -> dict[str, Any]:
    from memsvc.manager.policy import fields_from_config

    if not isinstance(raw, dict):
        raise InvalidArgument(f"{where} must be a table of policy fields")
    try:
        return fields_from_config(raw)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {str(exc).removeprefix('config: ')}") from None


def _table(raw: dict[str, Any], name: str, keys: Mapping[str, Any], where: str) -> dict[str, Any]:
    table = raw.get(name, {})
    if not isinstance(table, dict):
        raise InvalidArgument(f"{where}: [{name}] must be a table")
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise InvalidArgument(f"{where}: unknown [{name}] key(s) {unknown}; known: {sorted(keys)}")
    return {**keys, **table}


def _model(entry: object, i: int, where: str) -> ModelEntry:
    at = f"{where}: models[{i}]"
    if not isinstance(entry, dict):
        raise InvalidArgument(f"{at} must be a table")
    unknown = sorted(set(entry) - _MODEL_KEYS)
    if unknown:
        raise InvalidArgument(f"{at}: unknown key(s) {unknown}; known: {sorted(_MODEL_KEYS)}")
    model = entry.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidArgument(f"{at}.model: a checkpoint directory, a Hub id or synthetic:<preset> is required")
    name = entry.get("name", "")
    device = entry.get("device", 0)
    backend = entry.get("backend", "auto")
    args = entry.get("args", [])
    if not isinstance(name, str):
        raise InvalidArgument(f"{at}.name must be a string")
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise InvalidArgument(f"{at}.device must be an integer >= 0")
    if backend not in ("auto", "cuda", "host"):
        raise InvalidArgument(f"{at}.backend must be auto, cuda or host")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InvalidArgument(f"{at}.args must be a list of strings (more memsvc worker flags)")
    wid = entry.get("id") or _worker_id(name or model)
    if not isinstance(wid, str) or wid != _worker_id(wid):
        raise InvalidArgument(f"{at}.id must be letters, digits, '.', '_' and '-'")
    policy = _policy(entry.get("policy", {}), f"{at}.policy")
    return ModelEntry(wid, model, name, device, backend, tuple(args), policy)


def _placed(entry: ModelEntry, i: int, host: str, first: int, advertise: str, prefix: str) -> ModelEntry:
    """``entry`` as the ``i``-th model: its port (``first`` + i; 0 stays 0), its advertised address, its
    id after the prefix."""
    port = first + i if first else 0
    return dataclasses.replace(
        entry,
        listen=f"{host}:{port}",
        advertise=f"{advertise}:{port}" if advertise else "",
        worker_id=f"{prefix}-{entry.worker_id}" if prefix else entry.worker_id,
    )


def _checked(fields: Mapping[str, Any], where: str) -> None:
    """The manager's cross-field rules (memsvc/manager/policy.py's check) on a policy, here, before it
    is sent: one the manager would refuse is the file's error, not a failed start."""
    from memsvc.manager.policy import Policy, check

    try:
        check(Policy().with_fields(dict(fields)))
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {exc}") from None


def load_host_config(path: str | Path, env: Mapping[str, str] | None = None) -> HostConfig:
    """The file (TOML, or YAML by its suffix), checked: an unknown table or key, or a value of the wrong
    kind, is one error naming it. ``env`` (the process's by default) gives what ``[workers]`` leaves
    empty of ``advertise_host`` and ``id_prefix`` (:data:`ADVERTISE_HOST_VAR`, :data:`ID_PREFIX_VAR`)."""
    from memsvc.manager.config import read_config_file

    env = os.environ if env is None else env
    where = str(path)
    raw = read_config_file(path)
    unknown = sorted(set(raw) - _SECTIONS)
    if unknown:
        raise InvalidArgument(f"{where}: unknown table(s) {unknown}; known: {sorted(_SECTIONS)}")
    mgr = _table(raw, "manager", _MANAGER_KEYS, where)
    gw = _table(raw, "gateway", _GATEWAY_KEYS, where)
    workers = _table(raw, "workers", _WORKERS_KEYS, where)
    strings = [
        *(("manager." + k, v) for k, v in mgr.items()),
        ("gateway.listen", gw["listen"]),
        *(("workers." + k, v) for k, v in workers.items() if k not in ("standby", "stop_after")),
    ]
    for key, value in strings:
        if not isinstance(value, str):
            raise InvalidArgument(f"{where}: {key} must be a string")
    if not isinstance(workers["standby"], bool):
        raise InvalidArgument(f"{where}: workers.standby must be true or false")
    stop_after = workers["stop_after"]
    if isinstance(stop_after, bool) or not isinstance(stop_after, int | float) or not 0 <= stop_after <= 1e9:
        raise InvalidArgument(f"{where}: workers.stop_after must be a number of seconds >= 0 (0: never)")
    if mgr["address"] and set(raw.get("manager", {})) & {"listen", "metrics_listen", "state_dir"}:
        raise InvalidArgument(
            f"{where}: [manager] address is a manager elsewhere: it takes no listen, metrics_listen or state_dir"
        )
    host, _, port = workers["listen"].rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"{where}: workers.listen must be host:port (port 0: each worker picks one)")
    prefix = workers["id_prefix"] or env.get(ID_PREFIX_VAR, "")
    if prefix != _worker_id(prefix) and prefix:
        raise InvalidArgument(f"{where}: workers.id_prefix ({prefix!r}) must be letters, digits, '.', '_' and '-'")
    advertise = workers["advertise_host"] or env.get(ADVERTISE_HOST_VAR, "")
    if advertise and not int(port):
        raise InvalidArgument(f"{where}: workers.advertise_host needs workers.listen with a port (the first model's)")
    procs = gw["processes"]
    if isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
        raise InvalidArgument(f"{where}: gateway.processes must be an integer >= 1")
    entries = raw.get("models", [])
    if not isinstance(entries, list) or not entries:
        raise InvalidArgument(f"{where}: list the models to serve in [[models]] entries (model = ...)")
    first = int(port)
    models = tuple(_placed(_model(e, i, where), i, host, first, advertise, prefix) for i, e in enumerate(entries))
    if first and first + len(models) - 1 > 65535:
        raise InvalidArgument(f"{where}: workers.listen's port + the number of models passes 65535")
    seen: set[str] = set()
    for model in models:
        if model.worker_id in seen:
            raise InvalidArgument(f"{where}: two models have the worker id {model.worker_id!r}: give one an id")
        seen.add(model.worker_id)
    named = _policy(raw.get("policy", {}), f"{where}: [policy]")
    policy = {**_DEFAULT_POLICY, **named}
    if "idle_deep_sleep_timeout" not in named and policy["idle_sleep_timeout"] > policy["idle_deep_sleep_timeout"]:
        policy["idle_deep_sleep_timeout"] = 0.0  # memsvc up's tier 2 would come before the file's tier 1
    if stop_after and "start_timeout" not in named:
        policy["start_timeout"] = START_TIMEOUT_S  # an acquire for a stopped model waits for its start
    _checked(policy, f"{where}: [policy]")
    for model in models:
        _checked({**policy, **model.policy}, f"{where}: the policy of {model.worker_id}")
        if stop_after and not {**policy, **model.policy}["start_timeout"]:
            raise InvalidArgument(
                f"{where}: workers.stop_after needs a start_timeout above 0, and the policy of {model.worker_id} "
                "has 0: an acquire for it, stopped, would be refused, and nothing would start it"
            )
    return HostConfig(
        mgr["listen"],
        mgr["metrics_listen"],
        mgr["state_dir"],
        gw["listen"],
        procs,
        policy,
        models,
        workers["standby"],
        mgr["address"],
        float(stop_after),
    )


@dataclass
class _Worker:
    entry: ModelEntry
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    delay: float = RESTART_S[0]
    restart_at: float = 0.0
    policy_applied: bool = False
    refused: bool = False
    """It exited 2 (its flags or model refused): not restarted until the file changes."""
    sleep_once_loaded: bool = False
    """Restarted beside other models of its device: put to sleep once it has registered awake."""
    stale_address: str = ""
    """The address the manager knew it by before its restart: a record still showing it is the old
    process's, not the new one's."""
    stopped: bool = False
    """Stopped after ``[workers] stop_after`` asleep: not restarted until an acquire waits for it."""
    asleep_since: float | None = None
    """Since when (monotonic) the manager has shown it asleep, unleased and with nothing waiting."""


class Host:
    """The children of one ``memsvc up --config`` and what keeps them running (see the module)."""

    def __init__(self, path: str | Path, config: HostConfig, env: Mapping[str, str]) -> None:
        self.path = Path(path)
        self.config = config
        self.env = dict(env)
        self.manager: subprocess.Popen[bytes] | None = None
        self.gateway: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, _Worker] = {}
        self._stopping = False
        self._reload = False
        self._client: ManagerClient | None = None
        self._leaving: set[str] = set()
        """Models taken out of the file whose workers the manager has not deregistered yet."""
        self.standbys: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
        """With ``[workers] standby``: per (backend, device), a process waiting to be the next worker there."""

    # ---- signals ----
    def _stop(self, _signum: int, _frame: object) -> None:
        self._stopping = True

    def _hup(self, _signum: int, _frame: object) -> None:
        self._reload = True

    # ---- children ----
    def _spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, env=self.env)

    def _start_worker(self, w: _Worker, apply_policy: bool = True) -> None:
        """Start ``w``'s worker: handed to the standby of its device where there is one (its flags on its
        stdin; worker/standby.py), else a new process; then a new standby there, where the file asks.
        ``apply_policy``: send its overrides once it has registered (False: those the manager holds
        already stand)."""
        flags = w.entry.flags(self.config.manager)
        key = (w.entry.backend, w.entry.device)
        standby = self.standbys.pop(key, None)
        w.proc = None
        if standby is not None and standby.poll() is None and standby.stdin is not None:
            try:
                standby.stdin.write(json.dumps(flags).encode() + b"\n")
                standby.stdin.close()
                w.proc = standby
                announce(f"memsvc up: worker {w.entry.worker_id} started from the standby (pid {standby.pid})")
            except OSError:  # it died since it was looked at: a process of its own, as without one
                pass
        if w.proc is None:
            w.proc = self._spawn([*MEMSVC, "worker", *flags])
        w.started = time.monotonic()
        w.policy_applied = w.policy_applied and not apply_policy
        if self.config.standby and not self._stopping:
            self._spawn_standby(key)

    def _spawn_standby(self, key: tuple[str, int]) -> None:
        backend, device = key
        argv = [*MEMSVC, "worker", "--standby", "--backend", backend, "--device", str(device)]
        self.standbys[key] = subprocess.Popen(argv, env=self.env, stdin=subprocess.PIPE)

    def _manager_client(self) -> ManagerClient:
        from memsvc.client import ManagerClient

        if self._client is None:
            self._client = ManagerClient(self.config.manager)
        return self._client

    def _update_policy(self, name: str, fields: Mapping[str, Any]) -> None:
        """The file's policy, wholly: the default (``name`` empty) becomes the built-in policy with
        ``fields``; a worker's overrides become exactly ``fields`` (earlier ones cleared first). A
        refusal is a MemsvcError."""
        import grpc
        from google.protobuf.field_mask_pb2 import FieldMask

        from memsvc.manager.policy import Policy
        from memsvc.manager.wire import policy_pb
        from memsvc.runtime.rpc_errors import from_rpc_error
        from memsvc.v1 import memory_manager_service_pb2 as manager_pb

        proto = policy_pb(Policy().with_fields(dict(fields)))
        if name:
            requests = [manager_pb.UpdatePolicyRequest(name=name, clear_fields=["*"])]
            if fields:
                requests.append(
                    manager_pb.UpdatePolicyRequest(name=name, policy=proto, update_mask=FieldMask(paths=sorted(fields)))
                )
        else:
            requests = [
                manager_pb.UpdatePolicyRequest(policy=proto)
            ]  # no mask: every field, the file's or the built-in
        for request in requests:
            try:
                self._manager_client().stub.UpdatePolicy(request, timeout=10)
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
                    raise  # not up or not registered yet: the caller tries again
                raise from_rpc_error(exc) from None

    def _apply_default_policy(self) -> None:
        """The file's default policy, once the manager answers (at most :data:`READY_S`)."""
        import grpc

        deadline = time.monotonic() + READY_S
        while not self._stopping:
            try:
                self._update_policy("", self.config.policy)
                return
            except grpc.RpcError as exc:
                if time.monotonic() > deadline:
                    where = self.config.manager
                    raise Unavailable(f"the manager at {where} did not answer: {exc.details()}") from None
            self._manager_alive()
            time.sleep(0.1)

    def _manager_alive(self) -> None:
        if self.manager is not None and self.manager.poll() is not None and not self._stopping:
            raise Unavailable(f"the manager exited with {self.manager.returncode}")

    def _apply_overrides(self) -> None:
        """Each worker's policy overrides, once it has registered (the manager keeps overrides per
        known worker)."""
        import grpc

        for w in self.workers.values():
            if w.policy_applied:
                continue
            try:
                self._update_policy(f"workers/{w.entry.worker_id}", self._overrides(w.entry))
                w.policy_applied = True
            except grpc.RpcError:
                pass  # not registered yet (or the manager is busy): the next tick tries again
            except MemsvcError as exc:
                announce(f"memsvc up: the policy of {w.entry.worker_id}: {exc}", sys.stderr)
                w.policy_applied = True  # refused: said once, not every tick

    def _overrides(self, entry: ModelEntry) -> Mapping[str, Any]:
        """A worker's overrides: its own; with a manager elsewhere, ``[policy]`` under them."""
        return {**self.config.policy, **entry.policy} if self.config.manager_address else entry.policy

    # ---- reload ----
    def _reload_config(self) -> None:
        try:
            new = load_host_config(self.path, self.env)
        except MemsvcError as exc:
            announce(f"memsvc up: {self.path} not reloaded: {exc}", sys.stderr)
            return
        keep = {
            k: getattr(new, k)
            for k in (
                "manager_listen",
                "metrics_listen",
                "state_dir",
                "gateway_listen",
                "gateway_processes",
                "standby",
                "manager_address",
            )
        }
        if keep != {k: getattr(self.config, k) for k in keep}:
            announce("memsvc up: [manager], [gateway] and [workers] changes apply at the next start", sys.stderr)
        if self.config.manager_address:
            for w in self.workers.values():  # [policy] is under each worker's overrides: applied to each again
                w.policy_applied = w.policy_applied and new.policy == self.config.policy
        else:
            try:
                self._update_policy("", new.policy)
            except Exception as exc:  # noqa: BLE001 - a refusal, or the manager not answering: nothing changes
                announce(f"memsvc up: {self.path} not reloaded: its policy: {exc}", sys.stderr)
                return
        self.config = dataclasses.replace(self.config, policy=new.policy, stop_after=new.stop_after)
        wanted = {e.worker_id: e for e in new.models}
        gone = [w for wid, w in self.workers.items() if wanted.get(wid) != w.entry]
        stop_children([w.proc for w in gone if w.proc is not None])
        for w in gone:
            del self.workers[w.entry.worker_id]
            if w.entry.worker_id not in wanted:  # gone from the file: gone from the manager's list too
                self._leaving.add(w.entry.worker_id)
        self._leaving -= set(wanted)
        self._deregister_leaving()
        for wid, entry in wanted.items():
            if wid not in self.workers:
                self.workers[wid] = _Worker(entry)
                self._start_worker(self.workers[wid])
            elif self.workers[wid].stopped and not new.stop_after:  # nothing would start it on demand now
                self.workers[wid].stopped = False
                self._start_worker(self.workers[wid])
        self.config = dataclasses.replace(self.config, models=new.models)
        announce(f"memsvc up: {self.path} reloaded: {len(self.workers)} model(s), {len(gone)} stopped or restarted")

    def _deregister_leaving(self) -> None:
        """Deregister the workers of models taken out of the file. One still leased (a request that
        was running when it stopped; the gateway releases it as the stream ends, or its TTL does) is
        tried again at every tick until the manager takes it."""
        for wid in sorted(self._leaving):
            try:
                self._manager_client().deregister(wid)
            except (WrongState, Unavailable):
                continue  # still leased, or the manager busy: the next tick tries again
            except NotFound:
                pass
            except MemsvcError as exc:
                announce(f"memsvc up: {wid} stopped but not deregistered: {exc}", sys.stderr)
            self._leaving.discard(wid)

    # ---- the loop ----
    def run(self) -> int:
        cfg = self.config
        exe = MEMSVC
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGHUP, self._hup)
        if not cfg.manager_address:
            Path(cfg.state_dir).mkdir(parents=True, exist_ok=True)
            db = str(Path(cfg.state_dir) / "manager.db")
            self.manager = self._spawn(
                [*exe, "manager", "--listen", cfg.manager_listen, "--db", db, "--metrics-listen", cfg.metrics_listen]
            )
        try:
            if not cfg.manager_address:  # a manager elsewhere keeps its own default; [policy] is the workers'
                self._apply_default_policy()
            for i, entry in enumerate(cfg.models):
                if self._stopping:
                    return 0
                self.workers[entry.worker_id] = w = _Worker(entry)
                self._start_worker(w)
                if any(e.device == entry.device for e in cfg.models[i + 1 :]):
                    self._loaded_then_asleep(w)
            if self._stopping:
                return 0
            if cfg.gateway_listen:
                self.gateway = self._spawn(
                    [
                        *exe,
                        "gateway",
                        "--listen",
                        cfg.gateway_listen,
                        "--manager",
                        cfg.manager,
                        "--processes",
                        str(cfg.gateway_processes),
                    ]
                )
            return self._supervise()
        except MemsvcError as exc:
            if self._stopping:
                return 0
            announce(f"memsvc up: {exc}", sys.stderr)
            return 1
        finally:
            workers = [w.proc for w in self.workers.values() if w.proc is not None]
            standbys = list(self.standbys.values())
            for p in standbys:
                if p.stdin is not None:
                    p.stdin.close()  # the end of its input: it is not needed
            stop_children([p for p in (self.gateway, *standbys, *workers, self.manager) if p is not None])
            if self._client is not None:
                self._client.close()

    def _loaded_then_asleep(self, w: _Worker) -> None:
        """Wait until ``w`` has loaded (registered awake; at most :data:`LOAD_S`), then put it to sleep,
        so that the next model on its device loads with room. A worker that fails its load is left to
        the supervision loop (restarted)."""
        deadline = time.monotonic() + LOAD_S
        while not self._stopping and time.monotonic() < deadline and w.proc is not None and w.proc.poll() is None:
            self._manager_alive()
            if self._asleep_once_loaded(w):
                return
            time.sleep(0.2)

    def _address_of(self, worker_id: str) -> str:
        """The address the manager knows the worker by ("" if it cannot say)."""
        import grpc

        from memsvc.v1 import memory_manager_service_pb2 as manager_pb

        try:
            stub = self._manager_client().stub
            return str(
                stub.GetWorker(manager_pb.GetWorkerRequest(name=f"workers/{worker_id}"), timeout=10).worker.address
            )
        except grpc.RpcError:
            return ""

    def _asleep_once_loaded(self, w: _Worker) -> bool:
        """One look at ``w``: once it has registered awake, put it to sleep (its policy's tier-1
        actions); True when that is done (or it sleeps already, or the manager refuses: said once),
        False while it has not registered awake yet."""
        import grpc

        from memsvc.v1 import common_pb2 as common_pb
        from memsvc.v1 import memory_manager_service_pb2 as manager_pb

        name = f"workers/{w.entry.worker_id}"
        stub = self._manager_client().stub
        try:
            worker = stub.GetWorker(manager_pb.GetWorkerRequest(name=name), timeout=10).worker
            if w.stale_address and worker.address == w.stale_address:
                return False  # the process before the restart, as the manager last knew it
            state = worker.state
            if state == common_pb.WORKER_STATE_ASLEEP:
                return True  # asleep already (a policy, or an earlier run's state)
            if state == common_pb.WORKER_STATE_AWAKE:
                stub.SleepWorker(manager_pb.SleepWorkerRequest(name=name), timeout=120)
                return True
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                announce(f"memsvc up: {w.entry.worker_id} not put to sleep after its load: {exc.details()}", sys.stderr)
                return True
        return False

    def _supervise(self) -> int:
        while not self._stopping:
            if self._reload:
                self._reload = False
                self._reload_config()
            for name, p in (("manager", self.manager), ("gateway", self.gateway)):
                if p is not None and p.poll() is not None and not self._stopping:
                    announce(f"memsvc up: the {name} exited with {p.returncode}: stopping", sys.stderr)
                    return 1
            now = time.monotonic()
            for w in self.workers.values():
                self._tend(w, now)
                if (
                    w.sleep_once_loaded
                    and w.proc is not None
                    and (now - w.started > LOAD_S or self._asleep_once_loaded(w))
                ):
                    w.sleep_once_loaded = False
            self._tend_standbys()
            if self.config.stop_after:
                self._stop_or_start_on_demand(now)
            self._apply_overrides()
            if self._leaving:
                self._deregister_leaving()
            time.sleep(ON_DEMAND_TICK_S if any(w.stopped for w in self.workers.values()) else TICK_S)
        return 0

    def _tend_standbys(self) -> None:
        """A standby that exited before it was needed is said once and forgotten: the next start on its
        device starts a process of its own, and a new standby after it."""
        for key, p in list(self.standbys.items()):
            if p.poll() is not None:
                del self.standbys[key]
                backend, device = key
                announce(
                    f"memsvc up: the standby for --backend {backend} --device {device} exited with "
                    f"{p.returncode}; the next start there starts a process of its own",
                    sys.stderr,
                )

    def _stop_or_start_on_demand(self, now: float) -> None:
        """``[workers] stop_after``: stop each worker asleep that long (unleased, no acquire waiting);
        start each stopped one that an acquire waits for (the manager holds it for its start_timeout).
        Where other models share its device, those awake and unleased are put to sleep first, as at
        the start: the model loads with room. A stopped one whose model a restarted manager does not
        know is started too, to tell it.

        An acquire that comes between the look and the stop finds the process going: its wake fails,
        and the manager then waits for the start as for any other (memsvc/manager/leases.py)."""
        from memsvc.v1 import common_pb2 as common_pb

        try:
            seen = {wk.name.removeprefix("workers/"): wk for wk in self._manager_client().workers()}
        except MemsvcError:
            return  # the manager busy or restarting: the next tick looks again
        for w in self.workers.values():
            wk = seen.get(w.entry.worker_id)
            if w.stopped:
                # one the manager no longer lists (deregistered, pruned, or a manager elsewhere that lost
                # its store), or whose model a restarted manager does not know, cannot be routed to by
                # the gateway: started (and stopped again later) as well
                why = _start_reason(wk)
                if why:
                    self._asleep_neighbours(w, seen)
                    w.stopped, w.asleep_since = False, None
                    announce(f"memsvc up: worker {w.entry.worker_id} started on demand ({why})")
                    self._start_worker(w, apply_policy=False)  # its overrides stand (sent again, cleared first)
                continue
            if wk is None:
                continue
            idle = wk.state == common_pb.WORKER_STATE_ASLEEP and not wk.lease_count and not wk.waiting_acquires
            if not idle or w.proc is None or w.proc.poll() is not None:
                w.asleep_since = None
                continue
            w.asleep_since = w.asleep_since if w.asleep_since is not None else now
            if now - w.asleep_since >= self.config.stop_after:
                stop_children([w.proc])
                w.proc, w.stopped, w.asleep_since = None, True, None
                announce(
                    f"memsvc up: worker {w.entry.worker_id} stopped after {self.config.stop_after:g} s asleep; "
                    "an acquire for it starts it again"
                )

    def _asleep_neighbours(self, w: _Worker, seen: Mapping[str, Any]) -> None:
        """Put to sleep the other workers of ``w``'s device that are awake and unleased (a refusal,
        a leased one's, is left: the model then loads beside it)."""
        from memsvc.v1 import common_pb2 as common_pb

        for other in self.workers.values():
            wk = seen.get(other.entry.worker_id)
            same = (other.entry.backend, other.entry.device) == (w.entry.backend, w.entry.device)
            if other is w or not same or wk is None or wk.lease_count or wk.state != common_pb.WORKER_STATE_AWAKE:
                continue
            try:
                self._manager_client().sleep(other.entry.worker_id, timeout=120)
            except MemsvcError as exc:
                announce(f"memsvc up: {other.entry.worker_id} left awake beside {w.entry.worker_id}: {exc}", sys.stderr)

    def _tend(self, w: _Worker, now: float) -> None:
        """Restart ``w`` if it died (after its delay); one stopped on purpose waits for an acquire."""
        if w.refused or w.stopped:
            return
        if w.proc is not None and w.proc.poll() is not None:
            if w.proc.returncode == 2:  # a usage error: the same flags would be refused again
                announce(
                    f"memsvc up: worker {w.entry.worker_id} refused its start (exit 2, the line above says "
                    "why): not restarted; fix the file and send SIGHUP",
                    sys.stderr,
                )
                w.refused = True
                return
            lived = now - w.started
            w.delay = RESTART_S[0] if lived >= YOUNG_S else w.delay
            announce(
                f"memsvc up: worker {w.entry.worker_id} exited with {w.proc.returncode} after {lived:.0f} s; "
                f"restarting it in {w.delay:.0f} s",
                sys.stderr,
            )
            w.proc, w.restart_at = None, now + w.delay
            w.delay = min(w.delay * 2, RESTART_S[1])
        if w.proc is None and now >= w.restart_at:
            # it loads awake: where other models share its device, it sleeps once loaded, as at the start
            w.sleep_once_loaded = any(e.device == w.entry.device for e in self.config.models if e != w.entry)
            w.stale_address = self._address_of(w.entry.worker_id) if w.sleep_once_loaded else ""
            self._start_worker(w)


def _start_reason(wk: Any) -> str:
    """Why a stopped worker, as the manager lists it (None: not at all), is to start now; "" if not."""
    if wk is None:
        return "the manager does not list it"
    if wk.waiting_acquires > 0:
        return f"{wk.waiting_acquires} acquire(s) waiting"
    if not wk.status.model.served_model_name:
        return "its model unknown to a restarted manager"
    return ""


def run_host(path: str, child_vars: Mapping[str, str] | None = None) -> int:
    """``memsvc up --config PATH``: 2 for a file that does not load (one line naming what is wrong)."""
    env = {**os.environ, **(child_vars or {})}
    try:
        config = load_host_config(path, env)
    except MemsvcError as exc:
        announce(f"memsvc up: error: {exc}", sys.stderr)
        return 2
    os.environ.update(child_vars or {})  # this process's own calls to the manager use the same auth
    return Host(path, config, env).run()


__all__ = ["HostConfig", "ModelEntry", "load_host_config", "run_host"]

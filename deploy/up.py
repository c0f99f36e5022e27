"""``pdserve up``: the whole stack on this machine — N prefill + M decode workers and the
router, as the config says — until Ctrl-C or SIGTERM.

The resolved config (file + ``--set`` overrides) is written once and handed to every child,
so all processes agree on ports, model and connector. Workers log to
``$PDSERVE_HOME/logs/<router port>/`` (two stacks on one host differ in that port, so
neither writes over the other's logs); the launcher prints the URL once the router answers
/health. The resolved config lies beside the logs (``config-<host>-<launcher pid>.yaml``,
written again if the directory goes), removed at the stop; one a killed launcher left
behind is removed by the next start on the host.

A worker or the router that fails (exits non-zero, or is killed) is started again after
a backoff of 1 s, doubling to 30 s while it keeps failing soon after starting, as
compose's ``on-failure`` policy or a Kubernetes Deployment would; the router picks a
worker up once it is SERVING. A worker that exits 0 (drained after SIGTERM) is not
restarted; a router that does ends the stack. With ``planner.autoscale`` the launcher
starts each role's minimum and follows the router's plan (``deploy/autoscale.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from common.api_keys import API_KEYS_ENV
from common.config import PdserveConfig, Role
from common.config_base import ConfigError
from common.config_loader import to_dict
from common.hosts import host_port, ip_literal, local_host
from common.internal_auth import InternalAuth, open_ports_warning
from common.kv_budget import kv_budgets
from common.listen_sockets import bind_listeners, listen_error, worker_listeners
from common.model_info import cache_dir, made_model_dir, made_model_is_current, model_dir_of
from common.owned_paths import owner_tag, remove_dead_owners
from common.prometheus_text import fetch, sample_totals
from common.router_config import RouterConfig
from common.tracing import check_installed
from deploy.autoscale import Autoscaler, read_plan
from deploy.cpu_threads import usable_cores, worker_threads
from deploy.ephemeral_ports import ephemeral_port_warnings, ephemeral_range
from deploy.gpus import gpus_needed, surely_no_cuda, visible_gpus, worker_gpus
from deploy.health_cmd import check_grpc, check_http
from deploy.log_files import LOG_MAX_BYTES, cut_if_full, open_log
from deploy.parent_death import PARENT_PID_ENV


class StackError(RuntimeError):
    pass


_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 1.0, 30.0
# How long every worker and the router together may take to be ready: as long as a
# tensor-parallel shard may take to load (engine/parallel/shard_client.py); a large model
# took more than the 300 s this was. A process that exits while starting fails at once.
DEFAULT_START_TIMEOUT_S = 1800.0
_SHUTDOWN_S = 15.0  # after the drain grace: deregistering, the gRPC server's own stop
_STABLE_S = 60.0  # a worker that ran this long before failing starts over at 1 s
_LOG_CHECK_S = 5.0  # how often the children's log sizes are checked
_AVAILABLE = "pdserve:worker_available"  # the router's gauge: 1 per worker it places on


@dataclass
class _Restarts:
    """Per child process: its command, and when and how soon to start it again."""

    args: list[str]
    env: dict[str, str] | None = None  # its GPUs, if the host has any
    started_at: float = field(default_factory=time.monotonic)
    backoff_s: float = _FIRST_BACKOFF_S
    due_at: float | None = None  # set while it waits to be restarted


class Stack:
    def __init__(
        self,
        config: PdserveConfig,
        log_dir: Path,
        restart: bool = True,
        log_max_bytes: int = LOG_MAX_BYTES,
    ) -> None:
        self.config = config
        self.log_dir = log_dir
        self.restart = restart
        self.log_max_bytes = log_max_bytes  # per log file; one older part is kept
        self._next_log_check_at = 0.0
        self.children: list[tuple[str, subprocess.Popen]] = []
        self._log_starts: dict[str, int] = {}  # where each child's log was at its last start
        self._restarts: dict[str, _Restarts] = {}
        self.stop_signal = 0  # set by SIGINT/SIGTERM (see ``handle_signals``)
        log_dir.mkdir(parents=True, exist_ok=True)
        # Configs of this host's launchers that were killed (they could not remove their own).
        remove_dead_owners(log_dir, "config-", ".yaml")
        self.config_path = log_dir / f"config-{owner_tag()}.yaml"
        self._write_config()
        self._gpus: dict[tuple[Role, int], dict[str, str]] = {}  # set by start
        self._threads: dict[tuple[Role, int], dict[str, str]] = {}  # set by start
        # planner.autoscale: workers started and drained to the router's plan; those it
        # drained are not restarted, whatever their exit.
        self.autoscaler = Autoscaler(config) if config.planner.autoscale else None
        self._drained_by_plan: set[str] = set()
        # When each plan-drained worker is killed if it has not exited (its drain grace
        # plus _SHUTDOWN_S after its SIGTERM): a stuck drain must not keep its ports.
        self._drain_deadlines: dict[str, float] = {}
        self._num_signals = 0  # a second one during stop() kills what is left
        self._next_plan_at = 0.0

    def _write_config(self) -> None:
        """The config the children read, without the client keys (secrets: the router
        gets them in ``PDSERVE_API_KEYS``), readable by this user alone. It held the
        keys in plain text, mode 0644, for the whole run."""
        config = dataclasses.replace(
            self.config, router=dataclasses.replace(self.config.router, api_keys=[])
        )
        text = yaml.safe_dump(to_dict(config), sort_keys=False)
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(text)

    def _router_env(self) -> dict[str, str] | None:
        """The config's client keys, beside any this process was given."""
        keys = self.config.router.api_keys
        if not keys:
            return None
        given = os.environ.get(API_KEYS_ENV, "")
        return {API_KEYS_ENV: ",".join([*given.replace(",", " ").split(), *keys])}

    def handle_signals(self) -> None:
        """From now on SIGINT/SIGTERM/SIGHUP stop the stack: while it waits, and while it starts
        (a worker loading for minutes must not be orphaned by a Ctrl-C)."""

        def on_signal(signum: int, _frame) -> None:
            self.stop_signal = signum
            self._num_signals += 1

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGHUP, on_signal)  # the terminal (an ssh session) went away

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self.config_path.exists():  # the log directory was removed meanwhile
            self._write_config()
        command = [sys.executable, "-m", "deploy.cli", "--log-level", "INFO", *args,
                   "--config", str(self.config_path)]  # fmt: skip
        with open_log(self._log(name), self.log_max_bytes) as log:  # the child keeps a copy
            self._log_starts[name] = os.fstat(log.fileno()).st_size  # (``_cause`` reads on)
            # Its own session: a terminal's Ctrl-C (or hang-up) reaches the launcher alone,
            # which stops the router before the workers; a dead launcher still ends it
            # (``deploy/parent_death.py``: the child sets that up itself).
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **(env or {}), PARENT_PID_ENV: str(os.getpid())},
            )  # fmt: skip
        names = [n for n, _ in self.children]
        if name in names:  # a restart keeps its place
            self.children[names.index(name)] = (name, proc)
            self._restarts[name].started_at = time.monotonic()
        else:
            self.children.append((name, proc))
            self._restarts[name] = _Restarts(args, env)
        self._drain_deadlines.pop(name, None)
        return proc

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        self._gpus = self._gpu_env()  # raises ConfigError before anything starts
        self._threads = self._thread_env()
        workers = []
        for role in Role:
            section = self.config.role(role)
            count = self.autoscaler.initial(role) if self.autoscaler else section.replicas
            for index in range(count):
                name, proc = self._start_worker(role, index)
                workers.append((name, proc, host_port(section.host, section.ports(index).grpc)))
        # The router starts beside the workers, not after them, so its own start overlaps
        # their model loads; the stack is up once the router places work on every worker.
        router = self._spawn("router", ["router"], self._router_env())
        plural = "" if len(workers) == 1 else "s"
        print(f"starting {len(workers)} worker{plural} and the router (logs in "
              f"{self.log_dir})", flush=True)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        for name, proc, address in workers:
            self._wait_ready(name, proc, lambda a=address: check_grpc(a, "", 1.0)[0], deadline)
            print(f"  {name} ready on {address}", flush=True)
        self._wait_ready("router", router, lambda: self._router_ready(len(workers)), deadline)

    def _start_worker(self, role: Role, index: int) -> tuple[str, subprocess.Popen]:
        name = f"{role.value}-{index}"
        args = [role.value, "--index", str(index)]
        env = {**self._gpus.get((role, index), {}), **self._threads.get((role, index), {})}
        return name, self._spawn(name, args, env or None)

    def _router_ready(self, num_workers: int) -> bool:
        """The router answers /health and places new work on ``num_workers`` workers."""
        return (
            check_http(f"{self.url_root}/health", 1.0)[0]
            and _workers_available(f"{self.url_root}/metrics") >= num_workers
        )

    def _thread_env(self) -> dict[tuple[Role, int], dict[str, str]]:
        """Each worker's ``OMP_NUM_THREADS``: its share of this host's cores
        (``deploy/cpu_threads.py``), unless the user set the variable."""
        if "OMP_NUM_THREADS" in os.environ:
            return {}
        shares = worker_threads(self.config, usable_cores())
        return {worker: {"OMP_NUM_THREADS": str(n)} for worker, n in shares.items()}

    def _gpu_env(self) -> dict[tuple[Role, int], dict[str, str]]:
        """Each worker's CUDA_VISIBLE_DEVICES on a host with GPUs (``deploy.gpus``): its
        own ``tensor_parallel_size`` of them, so workers do not all land on GPU 0."""
        visible = visible_gpus()
        if not visible:
            return {}
        needed = gpus_needed(self.config)
        if needed > len(visible):
            print(f"warning: the workers need {needed} GPUs, {len(visible)} are visible; "
                  "some workers share GPUs", flush=True)  # fmt: skip
        return {
            worker: {"CUDA_VISIBLE_DEVICES": ",".join(visible[g] for g in gpus)}
            for worker, gpus in worker_gpus(self.config, len(visible)).items()
        }

    def _wait_ready(
        self, name: str, proc: subprocess.Popen, probe: Callable[[], bool], deadline: float
    ) -> None:
        """Until ``probe`` passes (the checks ``pdserve health`` runs); fails fast if the
        process, or any other started so far, exits (the router refusing its port had
        waited for every worker's model load), naming the cause its log ends with."""
        while time.monotonic() < deadline:
            if self.stop_signal:
                raise StackError(f"stopped by signal {self.stop_signal} while starting")
            for other, other_proc in self.children:
                if other_proc.poll() is not None:
                    raise StackError(self._exit_line(other, other_proc.returncode))
            if probe():
                return
            time.sleep(0.2)
        raise StackError(f"{name} was not ready in time (--start-timeout); see {self._log(name)}")

    def _log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _note(self, name: str, line: str) -> None:
        """``line`` in ``name``'s own log too, timestamped as its lines are: the log of a
        killed worker just began again ("listening on ..."), saying nothing of why."""
        try:
            with open(self._log(name), "a") as log:
                log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR launcher: {line}\n")
        except OSError:  # (its log directory gone: the line is on stderr anyway)
            pass

    def _exit_line(self, name: str, returncode: int) -> str:
        return f"{name} exited ({returncode}){self._cause(name, returncode)}; see {self._log(name)}"

    def _cause(self, name: str, returncode: int) -> str:
        """``": <why it ended>"``: the signal that killed it, else what it wrote since its
        last start (logs are appended to across starts and stacks): its ``error: ...``
        line, else its last line (a traceback's exception); "" when it wrote nothing."""
        if returncode < 0:
            return f": killed by {signal.Signals(-returncode).name}"
        try:
            with open(self._log(name), "rb") as log:
                end = log.seek(0, os.SEEK_END)
                start = self._log_starts.get(name, 0)
                log.seek(max(start if start <= end else 0, end - 16384))  # (cut: start over)
                lines = [line.strip() for line in log.read().decode(errors="replace").splitlines()]
        except OSError:
            return ""
        lines = [line for line in lines if line]
        errors = [line for line in lines if line.startswith("error: ")]
        cause = errors[-1].removeprefix("error: ") if errors else (lines[-1] if lines else "")
        return f": {cause[:500]}" if cause else ""

    @property
    def url_root(self) -> str:
        """Where this machine reaches the router: a wildcard ``router.host`` (0.0.0.0, ::)
        is no address to connect to, its family's loopback is."""
        router = self.config.router
        return f"http://{host_port(local_host(router.host), router.port)}"

    def wait(self) -> int:
        """Until a signal, or until the router stops for good: failed processes, the
        router included, are restarted (a router that exits 0 was drained on purpose)."""
        reported: set[str] = set()
        while not self.stop_signal:
            for name, proc in list(self.children):
                if proc.poll() is None or name in reported:
                    continue
                if name == "router" and (proc.returncode == 0 or not self.restart):
                    # Drained (its own SIGTERM): a stop, not a failure, which a supervisor
                    # restarting on failure would have undone.
                    print(f"the router exited ({proc.returncode}); stopping", file=sys.stderr)
                    return 0 if proc.returncode == 0 else 1
                # The router routes around a dead worker; the stack keeps serving (and
                # workers keep theirs while a failed router comes back).
                print(self._exit_line(name, proc.returncode), file=sys.stderr)
                if proc.returncode != 0:  # (a drain's exit 0 is in its own log already)
                    signal_name = self._cause(name, proc.returncode) if proc.returncode < 0 else ""
                    self._note(name, f"{name} exited ({proc.returncode}){signal_name}")
                reported.add(name)
                if self.restart and proc.returncode != 0 and name not in self._drained_by_plan:
                    self._schedule_restart(name)
            self._restart_due(reported)
            self._kill_stuck_drains()
            self._cut_full_logs()
            if self.autoscaler is not None and time.monotonic() >= self._next_plan_at:
                self._next_plan_at = time.monotonic() + self.config.planner.interval_s
                self._follow_plan(reported)
            time.sleep(0.2)
        return 0

    def _follow_plan(self, reported: set[str]) -> None:
        """Start or drain each role's workers to the router's plan (``deploy/autoscale.py``).
        Running: alive and not drained by the plan, or failed and due to restart, or failed
        under ``--no-restart`` (it stays down: the plan started it again every tick, with
        no backoff)."""
        assert self.autoscaler is not None
        plan = read_plan(f"{self.url_root}/metrics")
        procs = dict(self.children)
        for role in Role:
            running = sorted(
                index for index in range(self.config.role(role).replicas)
                if (name := f"{role.value}-{index}") in procs
                and name not in self._drained_by_plan
                and (procs[name].poll() is None or self._restarts[name].due_at is not None
                     or (not self.restart and procs[name].returncode != 0))
            )  # fmt: skip
            target = self.autoscaler.target(role, plan.get(role), len(running), time.monotonic())
            if target > len(running):
                free = [  # not running, and not still draining (its ports are taken)
                    i for i in range(self.config.role(role).replicas)
                    if i not in running and (f"{role.value}-{i}" not in procs
                                             or procs[f"{role.value}-{i}"].poll() is not None)
                ]  # fmt: skip
                for index in free[: target - len(running)]:
                    name, _ = self._start_worker(role, index)
                    # A new start, not a restart: a failure soon after waits 1 s, not the
                    # backoff its crash loop had reached before the plan drained it.
                    self._restarts[name].backoff_s = _FIRST_BACKOFF_S
                    self._drained_by_plan.discard(name)
                    reported.discard(name)
                    print(f"  plan: {role.value} workers {len(running)} -> {target}: started "
                          f"{name}", flush=True)  # fmt: skip
            elif target < len(running):
                name = f"{role.value}-{running[-1]}"
                self._drained_by_plan.add(name)
                self._restarts[name].due_at = None  # a failed one is not brought back
                procs[name].send_signal(signal.SIGTERM)
                self._drain_deadlines[name] = time.monotonic() + self._grace_s(name)
                print(f"  plan: {role.value} workers {len(running)} -> {target}: draining "
                      f"{name}", flush=True)  # fmt: skip

    def _schedule_restart(self, name: str) -> None:
        restarts = self._restarts[name]
        now = time.monotonic()
        if now - restarts.started_at >= _STABLE_S:
            restarts.backoff_s = _FIRST_BACKOFF_S
        restarts.due_at = now + restarts.backoff_s
        print(f"  restarting {name} in {restarts.backoff_s:.0f} s", file=sys.stderr, flush=True)
        self._note(name, f"restarting {name} in {restarts.backoff_s:.0f} s")
        restarts.backoff_s = min(restarts.backoff_s * 2, _MAX_BACKOFF_S)

    def _restart_due(self, reported: set[str]) -> None:
        now = time.monotonic()
        for name, restarts in self._restarts.items():
            if restarts.due_at is None or now < restarts.due_at:
                continue
            restarts.due_at = None
            self._spawn(name, restarts.args, restarts.env)
            reported.discard(name)
            print(f"  {name} restarted (logs in {self._log(name)})", file=sys.stderr, flush=True)

    def _cut_full_logs(self) -> None:
        """Every few seconds, each running child's log that reached its bound is cut
        (``deploy/log_files.py``)."""
        now = time.monotonic()
        if now < self._next_log_check_at:
            return
        self._next_log_check_at = now + _LOG_CHECK_S
        for name, proc in self.children:
            if proc.poll() is None and cut_if_full(self._log(name), self.log_max_bytes):
                print(f"  {name}'s log was full: moved to {self._log(name)}.1",
                      flush=True)  # fmt: skip

    def _grace_s(self, name: str) -> float:
        """How long ``name`` may take to exit after SIGTERM before it is killed."""
        role = name.split("-")[0]
        if role == "router":
            return self.config.router.drain_grace_s + _SHUTDOWN_S
        return self.config.role(Role(role)).drain_grace_s + _SHUTDOWN_S

    def _kill_stuck_drains(self) -> None:
        procs = dict(self.children)
        for name, deadline in list(self._drain_deadlines.items()):
            proc = procs[name]
            if proc.poll() is not None:
                del self._drain_deadlines[name]
            elif time.monotonic() >= deadline:
                print(f"  {name} did not drain in time: killed", file=sys.stderr, flush=True)
                proc.kill()
                proc.wait()
                del self._drain_deadlines[name]

    def stop(self) -> None:
        """Router first (no new requests), then every worker at once drains and exits;
        each is killed once its configured drain grace plus time to deregister and shut
        down has passed since its SIGTERM (not one after another: a stuck worker does not
        delay the others' deadlines), or at once on a second SIGINT/SIGTERM."""
        signals_before = self._num_signals

        def wait_all(deadlines: list[tuple[subprocess.Popen, float]]) -> None:
            while alive := [(p, d) for p, d in deadlines if p.poll() is None]:
                hurry = self._num_signals > signals_before
                for proc, deadline in alive:
                    if hurry or time.monotonic() >= deadline:
                        proc.kill()
                        proc.wait()
                time.sleep(0.05)

        procs = dict(self.children)
        running = any(proc.poll() is None for proc in procs.values())
        if running:  # (the console said nothing while the stack drained)
            _say("stopping: the workers drain and exit (a second Ctrl-C stops them at once)")
        router = procs.get("router")
        if router is not None and router.poll() is None:
            router.send_signal(signal.SIGTERM)
            wait_all([(router, time.monotonic() + self._grace_s("router"))])
        deadlines = []
        for name, proc in self.children:
            if name == "router":
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # (again, for a plan-drained one: a no-op)
            deadline = time.monotonic() + self._grace_s(name)
            deadlines.append((proc, min(deadline, self._drain_deadlines.get(name, deadline))))
        wait_all(deadlines)
        self.config_path.unlink(missing_ok=True)
        if running:
            _say("stopped")


def _say(line: str) -> None:
    """A line on the console, if there still is one: after SIGHUP (the terminal, an ssh
    session, went away) writing to it raises EIO, which must not cut the stop short."""
    with contextlib.suppress(OSError):
        print(line, flush=True)


def local_problems(config: PdserveConfig) -> list[str]:
    """What this machine lacks for the stack, checked before anything starts (``config
    check`` cannot: it may run where the model is not): the model's directory; a KV pool
    that cannot hold one request (on a host without CUDA, where ``config check`` can only
    warn, the workers surely run on the CPU); the LoRA adapters' directories; and the
    ports the router and the workers listen on (a second stack, or any other process).
    Each failed a worker 10-20 s after the start, the adapter's without its key."""
    problems = []
    model_dir = model_dir_of(config)
    if not model_dir.exists():  # (a hub id, say: nothing is downloaded)
        problems.append(f"model: {model_dir} does not exist (pdserve serves a checkpoint "
                        "directory on this machine; download the model first)")  # fmt: skip
    elif not (model_dir / "config.json").is_file():
        problems.append(f"model: {model_dir} is no checkpoint directory (no config.json)")
    else:
        problems += _pool_problems(config, on_cpu=surely_no_cuda())
    for name, path in config.lora.adapters.items():
        if not Path(path).is_dir():
            problems.append(f"lora.adapters.{name}: {path} is no directory on this machine")
    listeners = [("router.port", config.router.host, config.router.port, "")]
    for role in Role:
        section = config.role(role)
        for index in range(section.replicas):
            for name, port in worker_listeners(section.ports(index), config.kv_transfer.connector):
                listeners.append((f"{role.value}.port", section.host, port, name))
    for key, host, port, name in listeners:
        problem = _listen_problem(key, host, port, name)
        if problem is not None and problem not in problems:  # (a host's line: once)
            problems.append(problem)
    return problems


def _pool_problems(config: PdserveConfig, on_cpu: bool) -> list[str]:
    """The roles' KV pools as ``config check`` sizes them; ``on_cpu``: the host has no
    CUDA device, so what only a CPU worker cannot hold is an error too."""
    try:
        budgets = kv_budgets(config) or []
    except ConfigError as exc:
        return [str(exc)]
    if not on_cpu:
        return []
    lines = [f"{key}: {message} (this host has no CUDA device: its workers run on the CPU)"
             for budget in budgets for key, message in budget.cpu_problems]  # fmt: skip
    return list(dict.fromkeys(lines))  # (a key both roles share: once)


def _listen_problem(key: str, host: str, port: int, name: str) -> str | None:
    """Why ``host:port`` cannot be listened on now, or None (probed and closed; blamed as
    ``listen_error`` says, "another stack?" where the port is in use; ``name``: which of
    a worker's ports it is, as the worker itself says it)."""
    try:
        for probe in bind_listeners(host, port):  # as the servers will
            probe.close()
    except OSError as exc:
        return str(listen_error(key, host, port, exc, in_use="another stack?", name=name))
    return None


def _wildcard_note(router: RouterConfig) -> str | None:
    """For a wildcard ``router.host``: how other machines reach the router."""
    literal = ip_literal(router.host)
    if literal is None or not literal.is_unspecified:
        return None
    return (f"  router.host {router.host} is every IPv{literal.version} interface: from other "
            f"machines, http://<this machine's address>:{router.port}/v1")  # fmt: skip


def _workers_available(metrics_url: str) -> float:
    """How many workers the router places new work on (its ``pdserve:worker_available``
    series); 0 while it does not answer."""
    text = fetch(metrics_url, timeout_s=1.0)
    return 0 if text is None else sample_totals(text, [_AVAILABLE]).get(_AVAILABLE, 0)


def ensure_demo_model(config: PdserveConfig) -> None:
    if config.model is None and not made_model_is_current(made_model_dir()):
        print("making the demo model (first use)", flush=True)
        from engine.models.maker import ensure_model

        ensure_model()


def run(
    config: PdserveConfig, restart: bool = True, start_timeout_s: float = DEFAULT_START_TIMEOUT_S
) -> int:
    try:
        check_installed(config.tracing)  # every process would refuse to start
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for warning in ephemeral_port_warnings(config, ephemeral_range()):
        print(f"warning: {warning}", flush=True)
    try:  # (every child would refuse to start)
        InternalAuth.from_env()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    hosts = [config.role(role).host for role in Role]
    if (warning := open_ports_warning(hosts, os.environ)) is not None:
        print(f"warning: {warning}", flush=True)
    if config.planner.profile is not None:  # the router would refuse it after the workers load
        from planner.profile_data import ProfileError, read_profile

        try:
            read_profile(Path(config.planner.profile))
        except ProfileError as exc:
            print(f"error: planner.profile: {exc}", file=sys.stderr)
            return 2
    ensure_demo_model(config)
    if visible := visible_gpus():  # (the layout first: the config's problem, not the host's)
        try:
            worker_gpus(config, len(visible))
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if problems := local_problems(config):  # (each child would fail on it, one by one)
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    stack = Stack(config, cache_dir() / "logs" / str(config.router.port), restart)
    stack.handle_signals()
    try:
        stack.start(start_timeout_s)
        print(f"pdserve is up: {stack.url_root}/v1  (OpenAI API; Ctrl-C stops)", flush=True)
        if (note := _wildcard_note(config.router)) is not None:
            print(note, flush=True)
        return stack.wait()
    except ConfigError as exc:  # a worker needs more GPUs than the host has: nothing started
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StackError as exc:
        if stack.stop_signal:  # Ctrl-C or SIGTERM while starting: a normal stop
            return 0
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()

import contextlib
import errno
import fcntl
import os
import shlex
import shutil
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from config.banner import banner_lines
from config.demo import DemoCredentials, demo_bootstrap
from config.placement import Placement, available_cpus, plan_placement
from config.supervisor import ProcessSpec, Supervisor, python_path_env
from serving.services import deployment_register

ENGINE_SHUTDOWN_GRACE_SECONDS = 10  # the supervisor's grace period is 15 s


class Command(BaseCommand):
    help = (
        "Run the whole platform in the foreground: migrate, make sure the demo tenant, admin "
        "and API key exist (the embedded mode only), start the engine on MODEL_PATH and "
        "register it, a Celery worker with beat, and Daphne. Ctrl-C or SIGTERM stops "
        "everything."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        parser.add_argument("--no-demo", action="store_true", help="Skip the demo data")

    def handle(self, *args, **options) -> None:
        with self._var_dir_held(options["host"], options["port"]):
            self._run(options)

    @contextlib.contextmanager
    def _var_dir_held(self, host: str, port: int) -> Iterator[None]:
        """Hold ``VAR_DIR`` for this run alone: a second copy on the same checkout would share
        its engine socket and supervisor state, and stopping it took the first one's engine
        away. Refused, saying who has it."""
        var_dir = Path(settings.VAR_DIR)
        var_dir.mkdir(parents=True, exist_ok=True)
        with open(var_dir / "runplatform.lock", "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                holder = lock.read().strip() or "another process"
                raise CommandError(
                    f"The platform already runs on {var_dir} ({holder}): stop it first, or give "
                    "this one a VAR_DIR of its own."
                ) from None
            lock.seek(0)
            lock.truncate()
            lock.write(f"pid {os.getpid()}, http://{host}:{port}")
            lock.flush()
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _run(self, options: dict) -> None:
        call_command("migrate", interactive=False, verbosity=0)
        base_url = f"http://{options['host']}:{options['port']}"
        env = python_path_env(settings.BASE_DIR)
        env["HOST"] = options["host"]  # the web processes show debug pages on loopback only
        processes = []
        self.stdout.write(f"Mode: {'embedded' if settings.IS_EMBEDDED else 'production'}")
        placement = Placement(None, None, 0)
        if settings.RUN_ENGINE:
            try:
                placement = plan_placement(
                    available_cpus(), settings.WEB_PROCESSES, settings.ENGINE_CPUS
                )
            except ValueError as exc:
                raise CommandError(str(exc)) from None
            processes.append(self._engine(env, placement))
        _check_port_free(options["host"], options["port"])
        credentials = None
        if settings.IS_EMBEDDED and not options["no_demo"]:
            credentials = demo_bootstrap()
        self._banner(base_url, credentials)
        self.stdout.flush()
        web = self._web(options["host"], options["port"], env)
        if settings.RUN_WORKER:
            web += self._workers(env)
        processes += [replace(spec, cpus=placement.web_cpus) for spec in web]
        status_file = Path(settings.VAR_DIR) / "supervisor.json"
        exit_code = Supervisor(processes, status_file=status_file).run()
        if exit_code:
            raise CommandError(f"The platform stopped (exit code {exit_code}).")

    def _banner(self, base_url: str, credentials: DemoCredentials | None) -> None:
        """Every address a person opens, and what to sign in with."""
        for line in banner_lines(base_url, credentials):
            self.stdout.write(line)

    def _workers(self, env: dict[str, str]) -> list[ProcessSpec]:
        """Celery's worker with beat, on the default queue, and the batch runs' worker, on
        theirs: a batch that runs for hours holds its worker, and the other tasks (health
        polls, roll-ups, model loads) must not wait behind it."""
        celery = [sys.executable, "-m", "celery", "-A", "config", "worker", "--loglevel", "INFO"]
        default_queue = ["--queues", "celery", "--hostname", "celery@%h", "--beat"]
        batch_queue = ["--queues", settings.BATCH_QUEUE, "--hostname", "batches@%h"]
        # should the supervisor die without stopping them: Celery's cold shutdown (its warm
        # one, on SIGTERM, waits for the running task; a batch's lines are resumed later)
        cold = signal.SIGQUIT
        return [
            ProcessSpec(
                "celery",
                [*celery, *default_queue, *shlex.split(settings.CELERY_WORKER_ARGS)],
                env,
                parent_death_signal=cold,
            ),
            ProcessSpec(
                "celery-batches",
                [*celery, *batch_queue, *shlex.split(settings.BATCH_WORKER_ARGS)],
                env,
                parent_death_signal=cold,
            ),
        ]

    def _web(self, host: str, port: int, env: dict[str, str]) -> list[ProcessSpec]:
        """One Daphne on host:port, or ``WEB_PROCESSES`` of them sharing one listening socket
        that this process opens (the kernel hands each connection to one of them)."""
        count = settings.WEB_PROCESSES
        app = "config.asgi:application"
        if count < 1:
            raise CommandError("WEB_PROCESSES must be at least 1.")
        if count == 1:
            argv = ["--bind", host, "--port", str(port), app]
            return [ProcessSpec("daphne", [sys.executable, "-m", "config.webserver", *argv], env)]
        if not settings.REDIS_URL:
            raise CommandError(
                "WEB_PROCESSES > 1 needs REDIS_URL: the web processes share quotas, the chat's "
                "channel layer and the API's auth generation through it."
            )
        listener = socket.create_server((host, port), backlog=1024)
        listener.set_inheritable(True)
        self._listener = listener  # open for as long as the children run
        fd = listener.fileno()
        self.stdout.write(f"Web:     {count} Daphne processes on {host}:{port}")
        # a scrape of /metrics reaches one of them: each counts where all of them read
        metrics_dir = Path(settings.VAR_DIR) / "metrics"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        env = {**env, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
        return [
            ProcessSpec(
                f"daphne-{i}",
                [sys.executable, "-m", "config.webserver", "--fd", str(fd), app],
                env,
                pass_fds=(fd,),
            )
            for i in range(count)
        ]

    def _engine(self, env: dict[str, str], placement: Placement) -> ProcessSpec:
        model_path = Path(settings.MODEL_PATH)
        if not (model_path / "config.json").exists():
            raise CommandError(
                f"No model at {model_path}: set MODEL_PATH to a Hugging Face model directory, "
                "or RUN_ENGINE=0 to serve without a local engine."
            )
        deployment_register(name=settings.SERVED_MODEL_NAME, endpoints=[settings.ENGINE_ENDPOINT])
        self.stdout.write(
            f"Engine:  {settings.SERVED_MODEL_NAME} from {model_path} at {settings.ENGINE_ENDPOINT}"
        )
        if placement.engine_cpus is not None:
            self.stdout.write(
                f"  CPUs:  engine {_cpu_list(placement.engine_cpus)} "
                f"({placement.engine_threads} threads), web tier "
                f"{_cpu_list(placement.web_cpus or frozenset())}"
            )
        return ProcessSpec(
            name="engine",
            argv=[
                sys.executable,
                "-m",
                "inference_engine",
                "--model",
                str(model_path),
                "--endpoint",
                settings.ENGINE_ENDPOINT,
                "--served-model-name",
                settings.SERVED_MODEL_NAME,
                "--threads",
                str(placement.engine_threads),
                # within the supervisor's grace: the engine fails what is left itself
                "--shutdown-grace-period",
                str(ENGINE_SHUTDOWN_GRACE_SECONDS),
                *shlex.split(settings.ENGINE_ARGS),  # after ours: a flag given here wins
            ],
            env={**env, **placement.engine_env},
            cpus=placement.engine_cpus,
            stop_stage=0,  # before the web processes, which tell their streams it stopped
        )


def _cpu_list(cpus: frozenset[int]) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))


def _check_port_free(host: str, port: int) -> None:
    """Refuse a port something else listens on, before the banner shows a key and an address
    that would reach that other thing (Daphne could only loop on "Address already in use")."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # HOST=:: as Daphne takes it
    try:
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise CommandError(
                f"{host}:{port} is in use (another `make run`?): stop what listens there, or "
                "choose another port (PORT=8001 make run)."
            ) from None
        raise CommandError(f"Cannot listen on {host}:{port}: {exc.strerror or exc}.") from None

"""``--processes N``: start N local workers of the same command under ``jax.distributed``, relay and stop them.

Also sets up JAX for this process (simulated CPU devices, or a worker's place in the distributed run).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from einshard.errors import EinshardError

__all__ = ["configure_jax", "launch", "rebuild_argv"]


def configure_jax(args: argparse.Namespace) -> None:
    import jax

    if args.process_id is not None:
        _keep_cpp_chatter_off_stdout()
        jax.config.update("jax_num_cpu_devices", max(1, args.devices // args.processes))
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
        return
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return  # the caller chose the simulated device count
    try:
        # Only the CPU backend reads it: with an accelerator the real devices are used.
        jax.config.update("jax_num_cpu_devices", args.devices)
    except RuntimeError:
        pass  # the backend is already up (einshard_apps.cli.main called in-process): keep its devices


def _keep_cpp_chatter_off_stdout() -> None:
    """Send what C++ prints to file descriptor 1 (gloo's "[Gloo] Rank 0 is connected ...") to stderr.

    Python's block-buffered stdout and gloo's own writes share the pipe to the launcher, so gloo's line
    could land in the middle of one of ours, where no line filter can take it out again. Python's output
    keeps the pipe on a descriptor of its own, line-buffered; fd 1 becomes the worker's log (stderr).
    """
    sys.stdout.flush()
    ours = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(ours, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``args.processes`` local workers of this same command under jax.distributed; forward Ctrl-C."""
    if args.devices % args.processes:
        raise EinshardError(f"--devices {args.devices} does not split over --processes {args.processes}")
    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    # Each worker sets its own device count; a count in XLA_FLAGS would override it.
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
    )
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(args.processes)]
    procs = []
    for pid in range(args.processes):
        cmd = [sys.executable, "-m", "einshard", "demo", *argv, "--process-id", str(pid), "--coordinator", coordinator]
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE if pid == 0 else subprocess.DEVNULL,  # only process 0 prints
                text=True,
                stderr=logs[pid],
                start_new_session=True,  # Ctrl-C reaches this launcher alone; it tells the workers
            )
        )
    # Process 0's output (gloo's C++ connection chatter goes to its log: _keep_cpp_chatter_off_stdout).
    relay = threading.Thread(target=_relay, args=(procs[0].stdout,), daemon=True)
    relay.start()
    interrupted = False
    try:
        while any(p.poll() is None for p in procs):
            try:
                time.sleep(0.1)
            except KeyboardInterrupt:
                interrupted = True
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGINT)
            if any(p.returncode not in (None, 0, 130) for p in procs):
                # One worker failed: the others would wait for it forever in a collective.
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    relay.join(timeout=5)
    codes = [p.returncode for p in procs]
    if interrupted or codes[0] == 130:
        return 130
    if any(codes):
        for pid, (log, code) in enumerate(zip(logs, codes)):
            if code:
                log.seek(0)
                tail = [ln for ln in log.read().splitlines() if "[Gloo]" not in ln][-15:]
                print(f"einshard demo: process {pid} exited with {code}:", *tail, sep="\n  ", file=sys.stderr)
        return next(c for c in codes if c) if codes[0] == 0 else codes[0]
    return 0


def _relay(stream: Any) -> None:
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()


def rebuild_argv(args: argparse.Namespace) -> list[str]:
    """The command line of this run, minus --processes handling, for the workers."""
    out: list[str] = []
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        if key == "check":
            out.append("--check" if value else "--no-check")
        elif key in ("command", "process_id", "coordinator") or value is None or value is False:
            continue
        elif value is True:
            out.append(flag)
        else:
            out.extend([flag, str(value)])
    return out

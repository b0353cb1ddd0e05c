"""Warm start for `kvzip generate`: a background process that has already imported torch and transformers.

Importing torch and transformers 5.x takes about 4 s of a 2-core CPU before any model is touched, which is most of
what a `kvzip generate` waits for. Like a build tool's daemon, the first `kvzip generate` leaves behind a *warm
process* (`python -m kvzip.warm serve`): it imports those libraries once, then waits on a Unix socket. A later
`kvzip generate` (the `kvzip` console script enters here, in `main`) connects, hands over its argv, working directory,
environment and its stdin/stdout/stderr file descriptors, and the warm process forks a child that runs the command
exactly as the client would have, writing straight to the client's terminal. The client forwards Ctrl-C to the
child and exits with the child's exit code.

Safety rules, all enforced here:
- The socket lives in a 0700 folder (`$KVZIP_WARM_DIR`, default `$KVZIP_CACHE/run`) and only a peer with our uid is served.
- The socket's name hashes everything the warm process fixed at import time: the Python executable, the kvzip
  sources (paths, sizes, mtimes), torch's and transformers' install, and the environment variables those libraries
  read when imported. Edit the code or change e.g. OMP_NUM_THREADS and the next command gets a new warm process.
- The warm process never touches a model or CUDA (a forked child must initialise CUDA itself); it stays single-
  threaded so that forking it is safe, and exits after `$KVZIP_WARM_IDLE` seconds without a request (default 600).
- Anything unexpected on the client's side falls back to running the command in-process. `KVZIP_WARM=0` turns the
  whole mechanism off (the test suite does so, except for the test of this module).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import struct
import sys
from pathlib import Path

COMMANDS = ("generate",)  # commands served warm: the short-lived ones a user runs again and again
_ENV_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "CUDA_", "TORCH", "PYTORCH_", "HF_", "TRANSFORMERS_", "PYTHON", "LD_",
                 "NVIDIA_", "KVZIP_CACHE")
_HEADER = struct.Struct("!I")


def enabled(env: dict[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get("KVZIP_WARM", "1") not in ("0", "", "false", "no")


def _package_origin(name: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(name)  # a top-level package: located, not imported
    if spec is None or spec.origin is None:
        return ""
    st = os.stat(spec.origin)
    return f"{spec.origin}:{st.st_size}:{st.st_mtime_ns}"


def socket_path(env: dict[str, str] | None = None) -> Path | None:
    """Where the warm process for this interpreter, code and environment (default the current one) listens (None:
    path too long)."""
    env = os.environ if env is None else env
    h = hashlib.sha256()
    h.update(sys.executable.encode())
    for name in ("torch", "transformers"):
        h.update(_package_origin(name).encode())
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        st = path.stat()
        h.update(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode())
    for key in sorted(env):
        if key.startswith(_ENV_PREFIXES):
            h.update(f"{key}={env[key]}".encode())
    base = Path(env.get("KVZIP_WARM_DIR") or Path(env.get("KVZIP_CACHE", Path.home() / ".cache" / "kvzip")) / "run")
    path = base / f"warm-{os.getuid()}-{h.hexdigest()[:16]}.sock"
    return path if len(os.fsencode(path)) < 100 else None  # AF_UNIX paths are limited to ~108 bytes


# ---------------------------------------------------------------- client side (the `kvzip` console script)

def main() -> None:
    """Entry point of the `kvzip` console script: run warm when a warm process is there, else in-process."""
    argv = sys.argv[1:]
    env = dict(os.environ)  # as the user gave it: the command itself adds defaults that must not change the key
    eligible = enabled() and bool(argv) and argv[0] in COMMANDS and not {"-h", "--help"} & set(argv)
    if eligible:
        code = _run_remote(argv)
        if code is not None:
            sys.exit(code)
    from kvzip.cli import main as cli_main

    try:
        cli_main()
    finally:
        if eligible:
            spawn(env)


def _run_remote(argv: list[str]) -> int | None:
    """Run `kvzip argv` in the warm process; its exit code, or None when no warm process answered."""
    path = socket_path()
    if path is None or not path.exists():
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        payload = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        socket.send_fds(conn, [_HEADER.pack(len(payload)) + payload], [0, 1, 2])
        reader = conn.makefile("r")
        first = reader.readline().split()
        if len(first) != 2 or first[0] != "pid":
            return None  # the warm process went away before forking: nothing has run yet
    except OSError:
        conn.close()
        return None
    child = int(first[1])

    def forward(signum, frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    words = reader.readline().split()  # a forwarded signal interrupts nothing: the read is retried (PEP 475)
    if len(words) == 2 and words[0] == "exit":
        return int(words[1])
    print("kvzip: error: the warm process ended without an exit code (killed?)", file=sys.stderr)
    return 1


def library_env_defaults() -> None:
    """Quiet transformers' own progress bars and advisories (they would interleave with kvzip's display). Set before
    transformers is imported, in-process and in the warm process alike, since it reads some of them at import."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")


def _running(path: Path) -> bool:
    """Whether a warm process holds (or is starting under) this socket's lock."""
    import fcntl

    try:
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(lock, fcntl.LOCK_UN)
        return False
    except FileNotFoundError:
        return False
    except OSError:
        return True


def spawn(env: dict[str, str] | None = None) -> None:
    """Start a warm process in the background for this interpreter/code/environment (`env`, default the current
    one), if none is running."""
    env = dict(os.environ) if env is None else env
    if not enabled(env):
        return
    path = socket_path(env)
    if path is None or not path.parent.is_dir() and not _mkdir_private(path.parent) or _running(path):
        return
    import subprocess

    try:
        subprocess.Popen([sys.executable, "-m", "kvzip.warm", "serve"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                         env=env)
    except OSError:
        pass


def stop() -> bool:
    """Ask the warm process for this interpreter/code/environment to exit. True if one was there."""
    path = socket_path()
    if path is None or not path.exists():
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(path))
            payload = json.dumps({"stop": True}).encode()
            conn.sendall(_HEADER.pack(len(payload)) + payload)
            conn.recv(16)
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- server side (the warm process)

def _preload() -> None:
    """Import what every `kvzip generate` imports, without touching CUDA or any model."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    library_env_defaults()
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    import kvzip.engine  # noqa: F401
    import kvzip.methods  # noqa: F401  every method module, hence transformers' modeling utilities
    import kvzip.models  # noqa: F401


def _mkdir_private(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        return True
    except OSError:
        return False


def serve() -> None:
    import fcntl

    path = socket_path()
    if path is None or not _mkdir_private(path.parent):
        return
    lock = open(f"{path}.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another warm process for the same key is starting or running
    _preload()
    if path.exists():
        path.unlink()  # a stale socket of a process that died: we hold the lock, so nobody else uses it
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o600)
    server.listen(16)
    server.settimeout(float(os.environ.get("KVZIP_WARM_IDLE", "600")))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    try:
        while True:
            try:
                conn, _ = server.accept()
            except socket.timeout:
                break
            conn.settimeout(None)
            if not _same_user(conn):
                conn.close()
                continue
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            if request.get("stop"):
                conn.sendall(b"bye\n")
                conn.close()
                break
            if os.fork() == 0:
                server.close()
                _child(conn, request, fds)  # never returns
            conn.close()
            for fd in fds:
                os.close(fd)
    finally:
        server.close()
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _same_user(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return uid == os.getuid()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    if len(data) < _HEADER.size:
        raise ValueError("short request")
    (size,) = _HEADER.unpack_from(data)
    data = data[_HEADER.size:]
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise ValueError("truncated request")
        data += more
    return json.loads(data), list(fds)


def _child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: become the client's process (fds, cwd, env, argv), run the command, report its code."""
    code = 1
    try:
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["kvzip", *request["argv"]]
        sys.stdout.reconfigure(line_buffering=os.isatty(1))
        conn.sendall(f"pid {os.getpid()}\n".encode())
        from kvzip.cli import main as cli_main

        try:
            cli_main()
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
    except BaseException:  # a bug: keep the traceback, as the in-process command would
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        try:
            conn.sendall(f"exit {code}\n".encode())
        except OSError:
            pass
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    elif sys.argv[1:] == ["stop"]:
        print("stopped" if stop() else "no warm process")
    else:
        print("usage: python -m kvzip.warm serve|stop", file=sys.stderr)
        sys.exit(2)

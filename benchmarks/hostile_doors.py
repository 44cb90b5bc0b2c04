"""Issue 59's classes of hostile input, run for real against one tree of autotune: a real `autotune
serve` answered with curl, and the command line on real files, FIFOs and links. Run it on two trees
(one before the doors were closed, one after) to see each class before and after:

    git worktree add /tmp/before 7158913
    python benchmarks/hostile_doors.py --tree /tmp/before > before.txt
    python benchmarks/hostile_doors.py --tree .            > after.txt

Each case prints one row: its class, what was sent, and what came back (HTTP status and the answer's
first 110 characters, or the command's exit status and its last line of stderr). The tree's own
Python package is used (PYTHONPATH=TREE) with this interpreter; nothing is installed."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CURL_SECONDS = 20
COMMAND_SECONDS = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tree:
    """One tree's autotune, run with this Python in a scratch directory and home."""

    def __init__(self, tree: Path, scratch: Path) -> None:
        self.tree, self.scratch = tree.resolve(), scratch
        self.env = {
            **os.environ,
            "PYTHONPATH": str(self.tree),
            "HOME": str(scratch / "home"),
            "XDG_DATA_HOME": str(scratch / "home" / "data"),
            "AUTOTUNE_DB": "",
        }
        self.env.pop("AUTOTUNE_DB")
        (scratch / "home").mkdir()

    def command(self, *args: str, timeout: float = COMMAND_SECONDS, needle: str | None = None) -> tuple[str, str]:
        """(exit status, last line of stderr) of `autotune ARGS`, or the line of its output that holds
        `needle` where one does; 'hung' where it ran past `timeout`."""
        try:
            done = subprocess.run(
                [sys.executable, "-m", "autotune", *args],
                env=self.env,
                cwd=self.scratch,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return "hung", f"still running after {timeout:.0f} s (killed)"
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        shown = lines[-1] if lines else (done.stdout.strip().splitlines() or [""])[-1]
        if any(line.startswith("Traceback") for line in lines):
            shown = "TRACEBACK ... " + shown
        found = [line for line in done.stdout.splitlines() if needle and needle in line]
        if found:
            shown = f"the job script printed has the line {found[0].strip()!r}"
        return str(done.returncode), shown


def curl(port: int, method: str, path: str, headers: dict[str, str], body: str | None = None) -> tuple[str, str]:
    args = ["curl", "-s", "-o", "-", "-w", "\n%{http_code}", "-X", method, f"http://127.0.0.1:{port}{path}"]
    for key, value in headers.items():
        args += ["-H", f"{key}: {value}"]
    if body is not None:
        args += ["--data-binary", "@-"]
    done = subprocess.run(args, input=body, capture_output=True, text=True, timeout=CURL_SECONDS)
    text, _, status = done.stdout.rpartition("\n")
    return status, " ".join(text.split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, required=True, help="the autotune checkout to try")
    options = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="hostile-doors-"))
    rows: list[tuple[str, str, str, str]] = []
    try:
        run_cases(Tree(options.tree, scratch), scratch, rows)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for kind, case, status, said in rows:
        print(f"{kind:<22} | {case:<58} | {status:>5} | {said[:110]}")


def run_cases(tree: Tree, scratch: Path, rows: list) -> None:
    sys.path.insert(0, str(tree.tree))
    from tests.helpers.models import write_model_dir  # the tree's own helper: a tiny GPT-2 from config

    root = scratch / "models"
    write_model_dir(root / "tiny", n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128)
    secret = scratch / "secret.csv"
    secret.write_text("password,salary\nhunter2,1\n")
    db = f"sqlite:///{scratch / 'service.db'}"
    tokens = {}
    for name in ("alice", "bob"):
        done = subprocess.run(
            [sys.executable, "-m", "autotune", "token", "create", name, "--db", db],
            env=tree.env,
            cwd=scratch,
            capture_output=True,
            text=True,
            check=True,
        )
        tokens[name] = done.stdout.split()[-1]
    port = free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "autotune", "serve", "--db", db, "--port", str(port), "--model-root", str(root)]
        + ["--public-read"],
        env=tree.env,
        cwd=scratch,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        service_cases(port, tokens, root, secret, rows)
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(timeout=30)
    command_cases(tree, scratch, rows)


def service_cases(port: int, tokens: dict[str, str], root: Path, secret: Path, rows: list) -> None:
    host = {"Host": f"127.0.0.1:{port}"}
    alice = {**host, "Authorization": f"Bearer {tokens['alice']}", "Content-Type": "application/json"}
    search = {"model": "tiny", "gpu_budget": "200MiB", "device": "cpu", "micro_batches": [1], "block_sizes": "32"}

    def row(kind: str, case: str, answer: tuple[str, str]) -> None:
        rows.append((kind, case, *answer))

    row(
        "DNS rebinding",
        "GET /v1/searches, Host: evil.example",
        curl(port, "GET", "/v1/searches", {"Host": "evil.example"}),
    )
    cookie = {**host, "Cookie": f"autotune_token={tokens['alice']}", "Content-Type": "application/json"}
    body = json.dumps({**search, "study": "forged"})
    row(
        "cross-site write",
        "POST /v1/searches, cookie, Origin: http://evil.example",
        curl(port, "POST", "/v1/searches", {**cookie, "Origin": "http://evil.example"}, body),
    )
    row(
        "cross-site write",
        "POST /v1/searches, cookie, Origin: http://127.0.0.1:9",
        curl(port, "POST", "/v1/searches", {**cookie, "Origin": "http://127.0.0.1:9"}, body),
    )
    plain = {**alice, "Content-Type": "text/plain"}
    row(
        "JSON only",
        "POST /v1/searches, Content-Type: text/plain",
        curl(port, "POST", "/v1/searches", plain, json.dumps({**search, "study": "plain"})),
    )
    plan = json.dumps({"model": "tiny", "gpu_budget": "1GiB", "dataset": str(secret)})
    row(
        "files outside root",
        f"POST /v1/plan, dataset {secret.name} outside",
        curl(port, "POST", "/v1/plan", alice, plan),
    )
    plan = json.dumps({"model": "tiny", "gpu_budget": "1GiB", "tokenizer": "/etc"})
    row("files outside root", "POST /v1/plan, tokenizer /etc", curl(port, "POST", "/v1/plan", alice, plan))
    row(
        "answer shape",
        "POST /v1/searches, JSON 5,000 levels deep",
        curl(port, "POST", "/v1/searches", alice, "[" * 5000 + "]" * 5000),
    )
    row(
        "answer shape",
        'POST /v1/searches, {"model": "\\ud800"}',
        curl(port, "POST", "/v1/searches", alice, '{"model": "\\ud800"}'),
    )
    row("answer shape", "GET /v1/no-such-route", curl(port, "GET", "/v1/no-such-route", host))
    row("what it tells", "GET /healthz (no token)", curl(port, "GET", "/healthz", host))
    first = curl(port, "POST", "/v1/searches", alice, json.dumps({**search, "study": "shared"}))
    row("name taken over", "POST study 'shared' (alice)", first)
    other = json.dumps({**search, "study": "shared", "gpu_budget": "300MiB"})
    row("name taken over", "POST study 'shared' again, other budget", curl(port, "POST", "/v1/searches", alice, other))
    bob = {**alice, "Authorization": f"Bearer {tokens['bob']}"}
    row(
        "who may cancel",
        "POST /v1/searches/shared/cancel by bob",
        curl(port, "POST", "/v1/searches/shared/cancel", bob),
    )
    row("who may cancel", "POST .../shared/cancel by alice", curl(port, "POST", "/v1/searches/shared/cancel", alice))
    row(
        "who may cancel",
        "POST .../shared/cancel by alice again",
        curl(port, "POST", "/v1/searches/shared/cancel", alice),
    )
    row("what is happening", "GET /v1/workers", curl(port, "GET", "/v1/workers", host))


def command_cases(tree: Tree, scratch: Path, rows: list) -> None:
    def row(kind: str, case: str, answer: tuple[str, str]) -> None:
        rows.append((kind, case, *answer))

    slurm = ["search", "--model", "gpt2", "--gpu-budget", "8GiB", "--device", "cpu", "--launcher", "slurm"]
    row(
        "Slurm script",
        "--slurm-partition 'gpu\\ntouch /tmp/pwned' --dry-run",
        tree.command(*slurm, "--slurm-partition", "gpu\ntouch /tmp/pwned", "--dry-run", needle="pwned"),
    )
    row(
        "Slurm script",
        "--slurm-time '1:00:00 --uid=0' --dry-run",
        tree.command(*slurm, "--slurm-time", "1:00:00 --uid=0", "--dry-run", needle="--uid=0"),
    )
    fifo = scratch / "recipe.yml"
    os.mkfifo(fifo)
    row(
        "bounded reads",
        "search --from FIFO",
        tree.command("search", "--from", str(fifo), "--gpu-budget", "1GiB", timeout=10),
    )
    row(
        "bounded reads",
        "search --from /dev/zero",
        tree.command("search", "--from", "/dev/zero", "--gpu-budget", "1GiB", timeout=20),
    )
    bomb = scratch / "bomb.yml"
    lines = ["base_model: gpt2", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 8)]
    bomb.write_text("\n".join(lines) + "\n")
    row(
        "bounded reads",
        "search --from YAML alias bomb (10^8 values)",
        tree.command("search", "--from", str(bomb), "--gpu-budget", "1GiB"),
    )
    deep = scratch / "deep.yml"
    deep.write_text("base_model: gpt2\nx: " + "[" * 3000 + "]" * 3000 + "\n")
    row(
        "bounded reads",
        "search --from YAML 3,000 levels deep",
        tree.command("search", "--from", str(deep), "--gpu-budget", "1GiB"),
    )
    row(
        "answer shape",
        "search --launcher ray --ray-address ray://127.0.0.1:10001",
        tree.command(*slurm[:7], "--launcher", "ray", "--ray-address", "ray://127.0.0.1:10001"),
    )
    missing = f"sqlite:///{scratch / 'no-such-dir' / 'x.db'}"
    row(
        "nothing written",
        "worker --queue --db in a missing directory",
        tree.command("worker", "--queue", "--db", missing, timeout=15),
    )
    row(
        "nothing written",
        "  ... and was the directory made?",
        ("", "yes" if (scratch / "no-such-dir").exists() else "no"),
    )


if __name__ == "__main__":
    main()

"""Soak: drive an engine-core daemon (null model, CPU) for a set time with a mix of streams,
cancels, client crashes and bad requests, and sample every long-lived process each minute.

    PYTHONPATH=. python benchmarks/soak.py [--minutes 30] [--warmup-minutes 3] [--json out.json]

Processes: the daemon (engine-core) and its worker; two streaming clients (AsyncLLM.connect,
8 concurrent streams each: greedy streams checked token for token against the null model,
n=2 requests, sampled streams with logprobs and penalties, and one stream in five cancelled
part-way); a crashing client started every 10 s and SIGKILLed 1-4 s later with streams in
flight; and this driver, which sends garbage frames and requests the engine must refuse
(an out-of-vocabulary prompt, too many logprobs, a prompt over max_model_len) through a raw
client.

Each minute it records RSS, open fds and /dev/shm (files the process has open or mapped
there, and the directory's total) of the daemon, the worker, the two streamers and itself.
At the end it prints start (after warm-up), end and max per process, and the streams'
token accounting; it exits non-zero if a completed stream lost or repeated a token, or if a
process's RSS or fds ended more than 5% away from its value after warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STREAMS_PER_CLIENT = 8


# ---------------------------------------------------------------- the clients


def null_tokens(vocab: int, prompt_len: int, n: int) -> list[int]:
    """What the null model generates after a prompt of `prompt_len` tokens."""
    return [((prompt_len - 1 + i) * 7919) % (vocab - 16) + 16 for i in range(n)]


async def _one_stream(llm, vocab: int, rng: random.Random, name: str, stats: dict) -> None:
    from minivllm import RequestOutputKind, SamplingParams

    prompt_len = rng.randint(1, 120)
    # shared prefixes half the time, so the prefix cache is hit and evicted too
    base = 1 if rng.random() < 0.5 else rng.randint(2, vocab - 200)
    prompt = [base + i for i in range(prompt_len)]
    max_tokens = rng.randint(1, 400)
    kind = rng.choices(["greedy", "n2", "sampled"], weights=[7, 1, 2])[0]
    params = SamplingParams(
        n=2 if kind == "n2" else 1,
        temperature=0.0 if kind != "sampled" else 0.8,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        logprobs=3 if kind == "sampled" else None,
        presence_penalty=0.5 if kind == "sampled" else 0.0,
    )
    cancel_after = rng.randint(1, 20) if rng.random() < 0.2 else None
    got: dict[int, list[int]] = {}
    outputs = 0
    async for out in llm.generate(prompt, params, request_id=name):
        for completion in out.outputs:
            got.setdefault(completion.index, []).extend(completion.token_ids)
        outputs += 1
        if cancel_after is not None and outputs >= cancel_after:
            stats["cancelled"] += 1
            return  # leaving the loop aborts the request
    expected = null_tokens(vocab, prompt_len, max_tokens)
    for index in range(params.n):
        tokens = got.get(index, [])
        stats["tokens"] += len(tokens)
        stats["lost"] += max(0, max_tokens - len(tokens))
        stats["duplicated"] += max(0, len(tokens) - max_tokens)
        if kind != "sampled" and len(tokens) == max_tokens and tokens != expected:
            stats["wrong"] += 1
    stats["completed"] += 1


async def _streamer(address: str, vocab: int, seed: int, crash: bool) -> None:
    from minivllm import AsyncLLM

    llm = AsyncLLM.connect(address)
    rng = random.Random(seed)
    stats = dict(completed=0, cancelled=0, tokens=0, lost=0, duplicated=0, wrong=0)
    counter = 0

    async def worker(slot: int) -> None:
        nonlocal counter
        while True:
            counter += 1
            await _one_stream(llm, vocab, rng, f"s{seed}-{slot}-{counter}", stats)

    tasks = [asyncio.create_task(worker(i)) for i in range(STREAMS_PER_CLIENT)]
    print("ready", flush=True)
    last = time.monotonic()
    while True:
        await asyncio.sleep(1.0)
        if any(t.done() for t in tasks):
            for t in tasks:
                if t.done() and t.exception() is not None:
                    raise t.exception()
        if not crash and time.monotonic() - last > 10:
            last = time.monotonic()
            print(json.dumps(stats), flush=True)


def client_main(args: argparse.Namespace) -> None:
    import uvloop

    uvloop.run(_streamer(args.address, args.vocab, args.seed, args.role == "crasher"))


# ---------------------------------------------------------------- the driver


def _start_client(address: str, vocab: int, role: str, seed: int, log) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, __file__, "client", address, str(vocab), role, str(seed)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    assert proc.stdout.readline().strip() == "ready", f"{role} did not start"
    os.set_blocking(proc.stdout.fileno(), False)
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _shm(proc: psutil.Process) -> int:
    """Bytes of /dev/shm files `proc` has open or mapped."""
    paths = {f.path for f in proc.open_files() if f.path.startswith("/dev/shm")}
    paths |= {m.path for m in proc.memory_maps(grouped=True) if m.path.startswith("/dev/shm")}
    return sum(os.path.getsize(p) for p in paths if os.path.exists(p))


def _shm_total() -> int:
    total = 0
    for entry in os.scandir("/dev/shm"):
        with contextlib.suppress(OSError):  # a file removed meanwhile
            total += entry.stat().st_size
    return total


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _sample(procs: dict[str, int]) -> dict:
    row = {"t": time.time(), "shm_total": _shm_total(), "load": os.getloadavg()[0]}
    for name, pid in procs.items():
        p = psutil.Process(pid)
        row[name] = {"rss": p.memory_info().rss, "fds": p.num_fds(), "shm": _shm(p)}
    return row


class BadPeer:
    """Garbage frames and requests the engine must refuse, sent straight to the daemon."""

    def __init__(self, address: str, vocab: int) -> None:
        import zmq

        from minivllm.frontend.clients.mp_client import SyncMPClient

        self.rng = random.Random(7)
        self.vocab = vocab
        self.ctx = zmq.Context()
        self.garbage = self.ctx.socket(zmq.DEALER)
        self.garbage.connect(address)
        self.client = SyncMPClient.connect(address)
        self.refused = self.garbage_sent = 0

    def once(self) -> None:
        from minivllm import SamplingParams
        from minivllm.protocol.messages import EngineCoreRequest, FinishReason

        for _ in range(3):
            self.garbage.send(self.rng.randbytes(self.rng.randint(0, 200)))
            self.garbage_sent += 1
        # longer than max_model_len: dropped when decoded (no answer: the frontend's check
        # would have said so)
        too_long = EngineCoreRequest("long", list(range(1, 5000)), SamplingParams())
        self.client.add_request(too_long)
        self.garbage_sent += 1
        # what the model cannot serve: refused with an error output
        prompt, params = [
            ([self.vocab + 5], SamplingParams(max_tokens=4)),
            ([1, 2], SamplingParams(max_tokens=4, logprobs=1000)),
        ][self.rng.randrange(2)]
        self.client.add_request(EngineCoreRequest(f"bad-{self.refused}", prompt, params))
        out = self.client.get_output().outputs[0]
        assert out.finish_reason == FinishReason.ERROR, out
        self.refused += 1

    def close(self) -> None:
        self.client.shutdown()
        self.garbage.close(linger=0)
        self.ctx.term()


def _report(samples: list[dict], baseline: dict, names: list[str]) -> list[str]:
    """Rows of the per-process table, and whether every RSS and fd count held."""
    lines = [
        f"{'process':<12} {'RSS start MiB':>13} {'end':>8} {'max':>8} {'change':>7}"
        f" {'fds start':>9} {'end':>5} {'max':>5} {'shm':>5}"
    ]
    later = [s for s in samples if s["t"] >= baseline["t"]]
    for name in names:
        rss = [s[name]["rss"] for s in later]
        fds = [s[name]["fds"] for s in later]
        change = (rss[-1] - rss[0]) / rss[0] * 100
        lines.append(
            f"{name:<12} {rss[0] / 2**20:>13.1f} {rss[-1] / 2**20:>8.1f} {max(rss) / 2**20:>8.1f}"
            f" {change:>+6.1f}% {fds[0]:>9} {fds[-1]:>5} {max(fds):>5}"
            f" {max(s[name]['shm'] for s in later):>5}"
        )
    return lines


def _held(samples: list[dict], baseline: dict, names: list[str]) -> bool:
    end = samples[-1]
    return all(
        abs(end[n][k] - baseline[n][k]) <= 0.05 * baseline[n][k]
        for n in names
        for k in ("rss", "fds")
    )


def driver_main(args: argparse.Namespace) -> int:
    work = tempfile.mkdtemp(prefix="soak-")  # mode 700: the daemon's ipc socket lives here
    daemon, address, vocab = _start_daemon(work)
    worker = next(  # (not multiprocessing's resource tracker)
        c.pid
        for c in psutil.Process(daemon.pid).children()
        if "spawn_main" in " ".join(c.cmdline())
    )
    log = open(os.path.join(work, "clients.log"), "w")  # noqa: SIM115
    streamers = [_start_client(address, vocab, "streamer", s, log) for s in (1, 2)]
    procs = {"engine-core": daemon.pid, "worker": worker, "driver": os.getpid()}
    procs |= {f"streamer-{i + 1}": p.pid for i, p in enumerate(streamers)}
    bad = BadPeer(address, vocab)
    print(f"soak: {args.minutes} min, warm-up {args.warmup_minutes} min; logs in {work}")
    run = Run(args, procs, lambda seed: _start_client(address, vocab, "crasher", seed, log))
    try:
        run.drive(streamers, bad)
    finally:
        for s in [*streamers, *([run.crasher] if run.crasher else [])]:
            s.kill()
            s.wait()
        bad.close()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    return _summarize(args, run, bad, daemon.returncode)


def _start_daemon(work: str) -> tuple[subprocess.Popen, str, int]:
    """`minivllm engine-core` on the null model, listening: (its process, address, vocab)."""
    from minivllm.benchmarks.null_checkpoint import build_null_checkpoint, null_model_env

    model = build_null_checkpoint(os.path.join(work, "null"))
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    address = f"ipc://{work}/engine"
    daemon_log = open(os.path.join(work, "daemon.log"), "w")  # noqa: SIM115
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    daemon = subprocess.Popen(  # a process on its own: the null model is its plugin
        [sys.executable, "-m", "minivllm.frontend.cli", "engine-core", "--model", model]
        + ["--address", address],
        stdout=daemon_log,
        stderr=subprocess.STDOUT,
        env=null_model_env(env),
    )
    while "engine-core listening" not in _read(daemon_log.name):
        if daemon.poll() is not None:
            raise SystemExit(f"the daemon exited: {_read(daemon_log.name)}")
        time.sleep(0.5)
    return daemon, address, vocab


class Run:
    """The driver's loop and what it records: a sample of every process each
    --sample-every seconds (the one after the warm-up is the baseline), a crashing client
    every 10 s, bad requests and the streamers' counts every second."""

    def __init__(self, args: argparse.Namespace, procs: dict[str, int], start_crasher) -> None:
        self.args, self.procs, self.start_crasher = args, procs, start_crasher
        self.start = time.monotonic()
        self.end = self.start + 60 * args.minutes
        self.next_sample, self.next_crash = self.start, self.start + 5
        self.samples: list[dict] = []
        self.baseline: dict | None = None
        self.crasher: subprocess.Popen | None = None
        self.crash_at, self.crashes = 0.0, 0
        self.stats: dict[str, dict] = {}

    def drive(self, streamers: list[subprocess.Popen], bad: BadPeer) -> None:
        while True:
            now = time.monotonic()
            if (now >= self.next_sample or now >= self.end) and self._sample(now):
                return
            if self.crasher is None and now >= self.next_crash:
                self.crasher = self.start_crasher(100 + self.crashes)
                self.crash_at = now + random.uniform(1, 4)
            if self.crasher is not None and now >= self.crash_at:
                self._end_crasher(now)
            bad.once()
            for i, s in enumerate(streamers):
                if s.poll() is not None:
                    raise SystemExit(f"streamer-{i + 1} exited with {s.returncode}")
                for line in iter(s.stdout.readline, ""):
                    self.stats[f"streamer-{i + 1}"] = json.loads(line)
            time.sleep(1.0)

    def _end_crasher(self, now: float) -> None:
        _kill(self.crasher)
        self.crasher, self.crashes, self.next_crash = None, self.crashes + 1, now + 10

    def _sample(self, now: float) -> bool:
        """Record a sample; True once the run is over."""
        if self.crasher is not None:  # sample between crashes: a live crasher's sockets
            self._end_crasher(now)  # and pipes are not what stays
            time.sleep(1.0)
        self.samples.append(_sample(self.procs))
        if now >= self.end:
            return True
        if self.baseline is None and now - self.start >= 60 * self.args.warmup_minutes:
            self.baseline = self.samples[-1]
        self.next_sample += self.args.sample_every
        last = self.samples[-1]
        print(
            f"  {(now - self.start) / 60:5.1f} min: "
            + ", ".join(f"{n} {last[n]['rss'] >> 20} MiB/{last[n]['fds']} fds" for n in self.procs),
            flush=True,
        )
        return False


def _summarize(args: argparse.Namespace, run: Run, bad: BadPeer, daemon_exit: int) -> int:
    """Print the table and the streams' accounting; the exit status."""
    samples, baseline = run.samples, run.baseline or run.samples[0]
    names = list(run.procs)
    total = {k: sum(s[k] for s in run.stats.values()) for k in next(iter(run.stats.values()))}
    print("\n".join(_report(samples, baseline, names)))
    print(
        f"streams: {total['completed']} completed ({total['tokens']} tokens), "
        f"{total['cancelled']} cancelled; lost {total['lost']}, duplicated "
        f"{total['duplicated']}, wrong {total['wrong']}; {run.crashes} client crashes; "
        f"{bad.refused} requests refused, {bad.garbage_sent} garbage frames; "
        f"/dev/shm total {max(s['shm_total'] for s in samples)} bytes at most; "
        f"daemon exit {daemon_exit}"
    )
    held = _held(samples, baseline, names)
    clean = total["lost"] == total["duplicated"] == total["wrong"] == 0
    print(f"RSS and fds within 5% of warm-up: {held}; no lost or duplicated tokens: {clean}")
    if args.json:
        with open(args.json, "w") as f:
            figures = {"samples": samples, "baseline_t": baseline["t"], "streams": total}
            json.dump({**figures, "crashes": run.crashes, "refused": bad.refused}, f)
    return 0 if held and clean else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client")
    client.add_argument("address")
    client.add_argument("vocab", type=int)
    client.add_argument("role", choices=["streamer", "crasher"])
    client.add_argument("seed", type=int)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-minutes", type=float, default=3.0)
    parser.add_argument("--sample-every", type=float, default=60.0, help="seconds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.command == "client":
        client_main(args)
        return 0
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())

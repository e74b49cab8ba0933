"""Does the original ``deep_ep``'s low-latency mode start here? Asked in a child process, killed at a timeout.

Why: DeepEP's low-latency ``Buffer`` initialises NVSHMEM, and where NVSHMEM's IBGDA transport finds no network card
(a single H200 host without InfiniBand, for one) that initialisation never returns. A ``gc-moe-ab`` run that put a
DeepEP build on ``PYTHONPATH`` would then hang inside ``ComposedDeepEpDeepGemm`` forever, and nothing hangs silently
in this project. So before the composed operator creates the original's low-latency ``Buffer`` it runs this module
as ``python -m gc_moe_compat.ab.deep_ep_probe`` in a fresh Python: a gloo group of one rank on a free localhost port,
the original's low-latency ``Buffer`` for a tiny shape, one ``low_latency_dispatch`` + ``low_latency_combine``, a
device synchronize, exit 0. The parent kills the child (its whole session) after ``GC_MOE_AB_DEEP_EP_PROBE_S``
seconds (default 60) and keeps the verdict for the rest of the process (:func:`probe`). Under torchrun every rank
probes and the group agrees with :func:`agree` (any rank's failure: every rank uses the facade), so that the ranks
never disagree on the implementation.

The child inherits the environment (the user's ``NVSHMEM_*`` settings apply to the probe as to the run) less
torchrun's rendezvous variables, with the original's directory in front of ``PYTHONPATH``. It never imports
``bench/`` (bench/deep_ep_ab.py probes the same way for its benchmark, with rank groups of its own).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_TIMEOUT_S", "SETTING", "ChildResult", "Verdict", "agree", "child_command", "child_env",
           "clear_cache", "main", "probe", "probe_timeout", "run_child", "verdict_of"]

SETTING = "GC_MOE_AB_DEEP_EP_PROBE_S"
"""The setting that bounds the probe child (seconds)."""
DEFAULT_TIMEOUT_S = 60.0
"""The probe's bound where :data:`SETTING` is unset: NVSHMEM starts in seconds where it starts at all."""
TAIL_LINES = 5
"""How many of the child's last output lines a failure quotes."""
TAIL_CHARS = 800
"""The most characters of them it quotes (the line lands in a result file's meta)."""
RENDEZVOUS_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
"""torchrun's variables, dropped from the child's environment: the child is a group of its own, not a rank."""
PROBE_HIDDEN = 7168
PROBE_EXPERTS = 8
PROBE_TOPK = 2
PROBE_MAX_TOKENS = 128
"""The probe's tiny shape: hidden, experts, top-k and the Buffer's ``num_max_dispatch_tokens_per_rank`` (one token
is dispatched); hidden 7168 (DeepSeek-V3's) is in every DeepEP build's list of low-latency hiddens."""


@dataclass(frozen=True)
class Verdict:
    """Whether the original's low-latency mode may be used: ``ok``, else ``reason`` (why not, a whole phrase);
    ``seconds`` the probe took. Picklable: the ranks exchange it."""

    ok: bool
    reason: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class ChildResult:
    """How one probe child ended: its exit code (None: killed at the timeout), the last lines of its output."""

    returncode: int | None
    tail: str
    seconds: float


def probe_timeout(environ: Mapping[str, str] | None = None) -> float:
    """:data:`SETTING` in seconds (default :data:`DEFAULT_TIMEOUT_S`); ``ValueError`` naming it for a value that is
    not a positive number."""
    text = (os.environ if environ is None else environ).get(SETTING, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{SETTING}={text!r}: must be a positive number of seconds (default {DEFAULT_TIMEOUT_S:.0f})")
    return value


def _tail(text: str) -> str:
    """The child's last :data:`TAIL_LINES` non-empty lines, joined with `` | `` (at most :data:`TAIL_CHARS`)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()][-TAIL_LINES:]
    joined = " | ".join(lines)
    return joined if len(joined) <= TAIL_CHARS else "..." + joined[-TAIL_CHARS:]


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child and whatever it started (its own session, started by :func:`run_child`), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()
    proc.wait()


def run_child(command: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> ChildResult:
    """Run ``command`` with stdout and stderr into one temporary file (no pipe to fill and block on), wait up to
    ``timeout`` s, kill its session when it is still running; its exit code (None when killed) and output tail."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(list(command), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=None if env is None else dict(env), start_new_session=True)
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            code = None
        out.seek(0)
        text = out.read().decode(errors="replace")
    return ChildResult(code, _tail(text), time.monotonic() - start)


def verdict_of(result: ChildResult, where: str, timeout: float) -> Verdict:
    """The verdict on one child: exit 0 is a start; a kill at the timeout or another exit code is a failure whose
    reason names the original (``where``), what happened and the child's last output lines."""
    if result.returncode == 0:
        return Verdict(True, "", result.seconds)
    what = (f"did not start its low-latency mode within {timeout:g} s" if result.returncode is None
            else f"failed its low-latency probe (exit code {result.returncode})")
    return Verdict(False, f"the original deep_ep at {where} {what}: {result.tail or 'no output'}", result.seconds)


def child_command(device: int | None) -> list[str]:
    """This interpreter running the probe's entry point on CUDA device ``device`` (the rank's own)."""
    return [sys.executable, "-m", "gc_moe_compat.ab.deep_ep_probe", *([] if device is None else
                                                                       ["--device", str(device)])]


def child_env(original_dir: str | None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: this process's, less torchrun's :data:`RENDEZVOUS_VARS`, with the directory that
    holds the original ``deep_ep`` package first on ``PYTHONPATH`` (so the child finds the build the parent found)."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in RENDEZVOUS_VARS}
    if original_dir:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [original_dir, env.get("PYTHONPATH")]))
    return env


_cache: dict[int | None, Verdict] = {}


def clear_cache() -> None:
    """Forget the verdicts (tests)."""
    _cache.clear()


def probe(where: str, device: int | None = None, *, original_dir: str | None = None,
          command: Sequence[str] | None = None, timeout: float | None = None) -> Verdict:
    """The verdict on the original's low-latency mode on ``device``: a probe child (``command``, default
    :func:`child_command`) bounded by ``timeout`` (default :func:`probe_timeout`), run once per device and process
    and then cached (the run builds the composed operator once, its prebuild children each once)."""
    if device in _cache:
        return _cache[device]
    limit = probe_timeout() if timeout is None else timeout
    result = run_child(command or child_command(device), limit, child_env(original_dir))
    _cache[device] = verdict = verdict_of(result, where, limit)
    return verdict


def agree(verdicts: Sequence[Verdict]) -> Verdict:
    """The group's verdict from every rank's (in rank order): ok only where every rank's is, else the first failing
    rank's reason, prefixed ``rank N:`` in a group of several; ``seconds`` the slowest rank's."""
    slowest = max((v.seconds for v in verdicts), default=0.0)
    for rank, v in enumerate(verdicts):
        if not v.ok:
            prefix = f"rank {rank}: " if len(verdicts) > 1 else ""
            return Verdict(False, prefix + v.reason, slowest)
    return Verdict(bool(verdicts), "" if verdicts else "no rank reported a verdict", slowest)


# -- the child ---------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(device_index: int) -> None:
    """The probe itself: a one-rank gloo group, the original's low-latency Buffer, one dispatch + combine, sync."""
    import torch
    import torch.distributed as dist

    from gc_moe_compat import originals

    ep = originals.load("deep_ep")
    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    hint = ep.Buffer.get_low_latency_rdma_size_hint(PROBE_MAX_TOKENS, PROBE_HIDDEN, 1, PROBE_EXPERTS)
    buf = ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, num_qps_per_rank=PROBE_EXPERTS)
    x = torch.randn(1, PROBE_HIDDEN, dtype=torch.bfloat16, device=device)
    idx = torch.arange(PROBE_TOPK, dtype=torch.int64, device=device).view(1, PROBE_TOPK)
    weights = torch.full((1, PROBE_TOPK), 1.0 / PROBE_TOPK, dtype=torch.float32, device=device)
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, PROBE_MAX_TOKENS, PROBE_EXPERTS, use_fp8=True)
    rows = torch.zeros(PROBE_EXPERTS, PROBE_MAX_TOKENS, PROBE_HIDDEN, dtype=torch.bfloat16, device=device)
    buf.low_latency_combine(rows, idx, weights, handle)
    torch.cuda.synchronize()


def main(argv: Sequence[str] | None = None) -> int:
    """The child's entry point. It leaves through ``os._exit`` (exit 0 only after the synchronize; 1 with the
    traceback on stderr): no Buffer destructor or NVSHMEM teardown runs, which is not the probe's to wait for."""
    parser = argparse.ArgumentParser(prog="python -m gc_moe_compat.ab.deep_ep_probe",
                                     description="Start the original deep_ep's low-latency mode once; exit 0 if it "
                                                 "ran one dispatch + combine.")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    args = parser.parse_args(argv)
    code = 0
    try:
        _start(args.device)
        print("deep_ep low-latency probe: started", flush=True)
    except BaseException:  # noqa: BLE001 - any failure is the verdict, reported through the exit code
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

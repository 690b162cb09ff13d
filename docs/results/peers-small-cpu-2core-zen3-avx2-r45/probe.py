"""Where a served token's CPU goes: each process's CPU over 10 s with the server idle,
then over a one-stream `vllm bench serve` run (per token), and the decode worker's busiest
threads' run time, run-queue wait and context switches from the middle of that run.

    tandem serve --model /root/peers/models/small-llama --dtype bfloat16 --colocated \
        --quantization int8 --port 8811 &
    python docs/results/peers-small-cpu-2core-zen3-avx2-r45/probe.py 8811 small-llama 60
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import psutil

NAMES = ("raylet", "gcs_server", "log_monitor", "dashboard/agent", "dashboard.py", "runtime_env", "monitor.py")


def label(p: psutil.Process) -> str:
    cmd = " ".join(p.cmdline())
    for k in NAMES:
        if k in cmd:
            return k
    if cmd.startswith("ray::"):
        return cmd.split()[0]
    if "tandem serve" in cmd or "cli serve" in cmd:
        return "tandem serve (router)"
    if "vllm bench" in cmd:
        return "client (vllm bench serve)"
    return p.name()


def cpu_by_process() -> dict[int, tuple[str, float]]:
    out = {}
    for p in psutil.process_iter():
        try:
            t = p.cpu_times()
            out[p.pid] = (label(p), t.user + t.system)
        except psutil.Error:
            pass
    return out


def grouped(a: dict, b: dict) -> dict[str, float]:
    agg: dict[str, float] = {}
    for pid, (name, t) in b.items():
        if pid in a and t > a[pid][1]:
            agg[name] = agg.get(name, 0.0) + t - a[pid][1]
    return dict(sorted(agg.items(), key=lambda kv: -kv[1]))


def threads(pid: int) -> dict[str, tuple[int, int, int, int]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            run, wait, _ = open(f"/proc/{pid}/task/{tid}/schedstat").read().split()
            status = open(f"/proc/{pid}/task/{tid}/status").read()
            vol = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
            inv = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
            out[tid] = (int(run), int(wait), vol, inv)
        except (OSError, IndexError, ValueError):
            pass
    return out


def sample_worker(pid: int, after_s: float, dur_s: float, into: list) -> None:
    time.sleep(after_s)
    a = threads(pid)
    time.sleep(dur_s)
    b = threads(pid)
    rows = sorted(((b[t][0] - a[t][0], t) for t in b if t in a), reverse=True)[:4]
    for run, t in rows:
        d = [(b[t][i] - a[t][i]) / dur_s for i in range(4)]
        into.append(f"thread {t}: run {d[0] / 1e6:.0f} ms/s, run-queue wait {d[1] / 1e6:.0f} ms/s, "
                    f"{d[2]:.0f} voluntary and {d[3]:.0f} involuntary switches/s")


def main(port: str, model: str, prompts: int) -> None:
    a = cpu_by_process()
    time.sleep(10)
    idle = grouped(a, cpu_by_process())
    print(f"idle, ms of CPU a second (total {sum(idle.values()) * 100:.0f}):",
          {k: round(v * 100, 1) for k, v in idle.items() if v > 0.005})
    [worker] = [p.pid for p in psutil.process_iter() if " ".join(p.cmdline()).startswith("ray::DecodeWorker")]
    out = tempfile.mkdtemp()
    cmd = ["/root/peers/vllm-venv/bin/vllm", "bench", "serve", "--backend", "vllm", "--base-url",
           f"http://127.0.0.1:{port}", "--model", model, "--tokenizer", f"/root/peers/models/{model}",
           "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128",
           "--random-range-ratio", "0", "--ignore-eos", "--seed", "0", "--temperature", "0", "--num-prompts",
           str(prompts), "--max-concurrency", "1", "--disable-tqdm", "--save-result", "--result-dir", out,
           "--result-filename", "r.json"]
    sampled: list[str] = []
    # the worker's threads from 25 s into the run (past the client's start) for 30 s
    sampler = threading.Thread(target=sample_worker, args=(worker, 25.0, 30.0, sampled))
    a = cpu_by_process()
    client = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sampler.start()
    last = a
    while client.poll() is None:  # the client's own CPU, read while it lives
        last = cpu_by_process()
        time.sleep(0.5)
    sampler.join()
    busy = grouped(a, last)
    res = json.load(open(os.path.join(out, "r.json")))
    tokens = prompts * 127
    print(f"one stream: TPOT p50 {res['median_tpot_ms']:.2f} ms")
    print("ms of CPU a token:", {k: round(v * 1e3 / tokens, 3) for k, v in busy.items() if v > 0.01})
    print("the decode worker's busiest threads:", *sampled, sep="\n  ")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 60)

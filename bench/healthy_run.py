"""A long healthy run with hang detection on: no hang verdict may come from checkpoints, evaluations or the
first step. The quickstart with a checkpoint every 100 steps and an evaluation every 300 runs for --minutes:

- locally (default): under `kubetrain run`, then stopped (Ctrl-C: the workers checkpoint and exit); restarts
  and hang verdicts are counted from its summary.json and output;
- --real-pods: as a TrainingJob on the hack/ test cluster's real node, driven by this checkout's operator;
  status.restartCount, status.failures and status.lastHang are read every 30 s, then the job is deleted.

    .venv/bin/python bench/healthy_run.py --minutes 30 --out bench/results/healthy-run-local.json
    .venv/bin/python bench/healthy_run.py --real-pods --minutes 30 --out bench/results/healthy-run-real.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def manifest(where: Path) -> Path:
    job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    job["spec"].update(SPEC, data={"path": str(ROOT / "examples" / "data")})
    path = where / "healthy.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


SPEC = {"maxSteps": 1_000_000, "evalEverySteps": 300, "checkpoint": {"everySteps": 100, "keep": 3}}


def real_run(minutes: float) -> dict[str, object]:
    """The job on the real node for `minutes`; what its status said about restarts and hangs."""
    from in_place import apply_crd, namespace  # noqa: PLC0415 - the same cluster set-up as that bench
    from kubernetes import client, config  # noqa: PLC0415
    from support.cluster import cluster_running, cluster_up, kubeconfig_path  # noqa: PLC0415
    from support.operator_process import OperatorProcess  # noqa: PLC0415
    from support.real_pods import TRAINER_IMAGE, RealJobs, build_images, quickstart  # noqa: PLC0415

    if not cluster_running():
        cluster_up()
    os.environ["KUBECONFIG"] = str(kubeconfig_path())
    apply_crd()
    build_images()
    config.load_kube_config(str(kubeconfig_path()))
    admin = client.ApiClient()
    with tempfile.TemporaryDirectory() as tmp, namespace(client.CoreV1Api(admin), None) as ns, \
            OperatorProcess(kubeconfig_path(), Path(tmp, "operator.log"), trainer_image=TRAINER_IMAGE):
        jobs = RealJobs(admin, ns)
        name = jobs.create(quickstart(**SPEC), name="healthy")
        t0, st = time.monotonic(), {}
        while time.monotonic() - t0 < minutes * 60:
            time.sleep(30)
            st = jobs.status(name)
            print(f"{(time.monotonic() - t0) / 60:5.1f} min: step {st.get('currentStep')} phase {st.get('phase')} "
                  f"restarts {st.get('restartCount', 0)} lastHang {bool(st.get('lastHang'))}", flush=True)
        return {"where": "real pods", "minutes": round((time.monotonic() - t0) / 60, 1),
                "steps": st.get("currentStep"), "checkpoints": (st.get("lastCheckpoint") or {}).get("step", 0) // 100,
                "evaluations": (st.get("currentStep") or 0) // 300, "restarts": st.get("restartCount", 0),
                "failures": st.get("failures", {}), "hang_verdicts": int(bool(st.get("lastHang"))),
                "phase": st.get("phase")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--real-pods", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = real_run(args.minutes) if args.real_pods else local_run(args.minutes)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["hang_verdicts"] == 0 and result["restarts"] == 0 else 1


def local_run(minutes: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out")
        cmd = [sys.executable, "-m", "kubetrain.core", "run", str(manifest(Path(tmp))), "--output-dir", str(out)]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(minutes * 60)
        proc.send_signal(signal.SIGINT)
        text, _ = proc.communicate(timeout=600)
        summary = json.loads((out / "summary.json").read_text())
        return {
            "where": "kubetrain run", "minutes": round((time.monotonic() - t0) / 60, 1), "steps": summary["steps"],
            "checkpoints": len(summary["checkpoints"]), "evaluations": summary["steps"] // 300,
            "restarts": summary["restarts"], "failures": summary["failures"],
            "hang_verdicts": text.count("restarting: hung:"), "phase": summary["phase"],
        }


if __name__ == "__main__":
    sys.exit(main())

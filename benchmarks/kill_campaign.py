"""Kill campaign: stop a demo-sized training run at random moments, follow what tformer says, and check
that the final weights equal those of a run that was never stopped, bit for bit.

    python benchmarks/kill_campaign.py                     # 20 kills each of SIGKILL, SIGINT, SIGTERM
    python benchmarks/kill_campaign.py --kills 5 --signals KILL --json out.json
    python benchmarks/kill_campaign.py --kills 5 --set train.step_tokens=6000   # 2 batches a step

Each trial starts `tformer train` on the demo model (shortened), sends the signal at a random moment of
the run (setup, a step, validation, a checkpoint write: the moments are drawn over the whole run, and a
quarter of the trials wait for a checkpoint write to begin and stop it there), then does what a user
would: for SIGINT and SIGTERM it runs the command printed on stderr ("resume with: ..." or "start it
again with: ..."); after SIGKILL, which leaves no message, it runs the original command again and, if
that answers that the folder holds a run, the `--resume` command that answer names. The trial passes
when that command exits 0 and the run's final weights (model.safetensors and the last checkpoint)
equal the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SIGNALS = {"KILL": signal.SIGKILL, "INT": signal.SIGINT, "TERM": signal.SIGTERM}


def campaign_config(folder: Path, steps: int, overrides: list[str] = ()) -> Path:
    """configs/demo.yaml, shortened to ``steps`` and checkpointed often, with no time limit (a limit in
    seconds would stop a resumed run at another step than an uninterrupted one); then ``overrides``,
    read as ``tformer train --set`` reads them (a mistake raises ``ConfigError``, one line)."""
    from tformer_cli.config import load_config, to_yaml

    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    config["data"]["dataset"] = str(ROOT / "data" / "numbers")
    config["train"].update(max_steps=steps, max_time=None, eval_every=steps // 3, save_every=steps // 6,
                           log_every=10, keep_last=100, eval_max_sentences=100, device="cpu")
    path = folder / "campaign.yaml"
    path.write_text(yaml.safe_dump(config))
    if overrides:
        path.write_text(to_yaml(load_config(path, list(overrides))))
    return path


def tformer(*args: str) -> list[str]:
    return [sys.executable, "-m", "tformer_cli", *args]


def weights(run_dir: Path) -> dict[str, bytes]:
    """The run's final weights as bytes: its model.safetensors and its last step checkpoint's."""
    from safetensors.torch import load_file

    last = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    out = {}
    for name, path in (("model", run_dir / "model.safetensors"), ("last", last / "model.safetensors")):
        for key, tensor in load_file(str(path)).items():
            out[f"{name}/{key}"] = tensor.numpy().tobytes()
    return out


def follow_up(process_stderr: str, original: list[str], signame: str, env: dict) -> tuple[list[str], str]:
    """The command a user runs next, and where it came from."""
    if signame != "KILL":
        match = re.search(r"(?:resume with|start it again with): (.+)$", process_stderr.strip(), re.MULTILINE)
        if match:
            words = shlex.split(match.group(1))
            assert words[0] == "tformer", words
            return tformer(*words[1:]), "the stop message"
    # no stop message: a SIGKILL, or a signal that landed before tformer started or as the finished run's
    # interpreter exited (Python then dies of SIGINT, -2, saying nothing); the user runs the same command
    # again and does what it answers
    again = subprocess.run(original, capture_output=True, text=True, env=env, cwd=ROOT)
    if again.returncode == 0:
        return [], "the same command again (nothing to resume)"
    match = re.search(r"continue it with (--resume [^\s,]+)", again.stderr)
    if not match:
        raise RuntimeError(f"the same command failed without naming a resume: {again.stderr.strip()}")
    return tformer("train", *shlex.split(match.group(1)), "--quiet"), "the same command's answer"


def trial(config: Path, run_dir: Path, signame: str, delay: float | None, env: dict) -> dict:
    """One kill: at ``delay`` seconds, or (None) as soon as a checkpoint write begins."""
    shutil.rmtree(run_dir, ignore_errors=True)
    original = tformer("train", str(config), "--output-dir", str(run_dir), "--quiet")
    process = subprocess.Popen(original, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    start = time.perf_counter()
    signalled = False
    phase = "timed"
    if delay is None:
        phase = "checkpoint write"
        while process.poll() is None and not list((run_dir / "checkpoints").glob(".step-*.tmp")):
            time.sleep(0.0005)
    else:
        while process.poll() is None and time.perf_counter() - start < delay:
            time.sleep(0.005)
    landed = _where(run_dir) if phase == "timed" else phase
    if process.poll() is None:
        process.send_signal(SIGNALS[signame])
        signalled = True
    _, stderr = process.communicate()
    at = time.perf_counter() - start
    if not signalled:  # the run was over first: nothing was tested
        return {"signal": signame, "at_s": round(at, 2), "phase": "finished first"}
    if process.returncode == 0:  # the signal landed as the finished run was exiting: nothing to resume
        command, source = [], "the run had finished (exit 0)"
    else:
        command, source = follow_up(stderr, original, signame, env)
    code = subprocess.run(command, capture_output=True, env=env, cwd=ROOT).returncode if command else 0
    return {"signal": signame, "at_s": round(at, 2), "phase": landed, "exit": process.returncode,
            "message": stderr.strip().splitlines()[-1] if stderr.strip() else "", "next": source,
            "resume_exit": code}


def _where(run_dir: Path) -> str:
    """Roughly where the run was when the signal was sent (from what it had written)."""
    if not (run_dir / "config.yaml").is_file():
        return "setup"
    if list((run_dir / "checkpoints").glob(".step-*.tmp")):
        return "checkpoint write"
    return "training" if list((run_dir / "checkpoints").glob("step-*")) else "first steps"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="trials per signal")
    parser.add_argument("--signals", default="KILL,INT,TERM")
    parser.add_argument("--steps", type=int, default=120, help="length of the run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every trial here")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override of the campaign's runs, e.g. train.step_tokens=6000")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="tformer-kills-"))
    env = {**os.environ, "TFORMER_CACHE": str(work / "cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    from tformer_cli.errors import ConfigError

    try:
        config = campaign_config(work, args.steps, args.set)
    except ConfigError as error:
        shutil.rmtree(work, ignore_errors=True)
        parser.error(str(error))
    from tformer_cli.config import load_config

    if load_config(config).data.bpe_dropout:  # no uninterrupted run to compare with
        shutil.rmtree(work, ignore_errors=True)
        parser.error("data.bpe_dropout: tokenizers draws its segmentations without a seed, so no two runs "
                     "match; a resume's exactness under it is tested with recorded draws (tests/test_train.py)")
    start = time.perf_counter()
    subprocess.run(tformer("train", str(config), "--output-dir", str(work / "reference"), "--quiet"),
                   check=True, env=env, cwd=ROOT)
    length = time.perf_counter() - start
    reference = weights(work / "reference")
    print(f"uninterrupted run: {args.steps} steps in {length:.1f} s ({work})", flush=True)
    trials = []
    for signame in args.signals.split(","):
        for i in range(args.kills):
            for _ in range(5):  # a moment past the end of the run (slower than the first) is drawn again
                delay = None if i % 4 == 3 else rng.uniform(0.2, 0.85 * length)
                result = trial(config, work / "run", signame, delay, env)
                if result["phase"] != "finished first":
                    break
                length = min(length, result["at_s"])
            result["exact"] = result.get("resume_exit") == 0 and weights(work / "run") == reference
            trials.append(result)
            print(json.dumps(result), flush=True)
        done = [t for t in trials if t["signal"] == signame]
        print(f"SIG{signame}: {sum(t['exact'] for t in done)} of {len(done)} resumed to the same weights", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "uninterrupted_s": length, "trials": trials}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if all(t["exact"] for t in trials) else 1)


if __name__ == "__main__":
    main()

"""The CLI end to end, as a user runs it: a real subprocess where the process matters (the full run's
output to a pipe), `main([...])` in this process where it does not (each child costs ~5 CPU-s of
imports; a SIGTERM is sent to this process, through the handler main installs)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

SMALL = ["model.num_layers=2", "model.d_model=64", "model.mlp_dim=256", "model.head_dim=16", "model.seq_len=64"]


def test_cli_trains_on_the_default_corpus(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "jaxdist.train",
        "--mesh",
        "dp=2,fsdp=4",
        "--steps",
        "60",
        "--run-dir",
        str(run_dir),
        *SMALL,
        "optim.lr=1e-2",
        "optim.warmup_steps=5",
        "train.log_every=5",
        "train.eval_every=30",
        "train.global_batch=16",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mesh dp=2,fsdp=4 over 8 cpu devices" in out.stdout
    assert "MFLOP/token" in out.stdout and out.stdout.strip().splitlines()[-1].startswith("done: 60 steps")

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["train"]["steps"] == 60 and resolved["mesh"]["shape"] == "dp=2,fsdp=4"

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(5, 61, 5))  # eval steps 30, 60 are log steps too
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s", "flops_per_sec"):
        assert all(key in r for r in steps), key
    assert not any("mfu" in r for r in records)  # CPU: no datasheet peak, so no MFU
    evals = [r["eval_loss"] for r in records if "eval_loss" in r and "summary" not in r]
    assert len(evals) == 2
    rates = [r["tokens_per_sec"] for r in steps]
    assert max(rates) < 20 * min(rates)  # every interval is timed over whole steps (no near-zero intervals)
    summary = records[-1]
    assert summary["summary"] and summary["steps"] == 60
    # Bytes of Python source: from ln(256) = 5.55 at the start to well below in 60 small steps.
    assert steps[0]["loss"] > 3.5 and summary["final_loss"] < 3.0 and summary["eval_loss"] < 3.0
    assert any((run_dir / "tb").iterdir())  # TensorBoard events
    # stdout is a pipe: one plain line per log interval (no tqdm stream), and the loss picture at the end
    plain = [x for x in out.stdout.splitlines() if x.startswith("step ")]
    assert [x.split(" | ")[0] for x in plain] == [f"step {s}/60" for s in range(5, 61, 5)]
    assert "\r" not in out.stdout + out.stderr and (run_dir / "loss.png").stat().st_size > 20_000


def test_cli_bad_input_exits_2_without_traceback(tmp_path, capsys):
    """In this process (a real process's one-line stderr is test_safety's resume-error test)."""
    from jaxdist import train

    assert train.main(["--mesh", "dp=3", "--run-dir", str(tmp_path / "r")]) == 2
    assert (
        capsys.readouterr().err.strip() == "error: mesh dp=3 needs 3 devices but there are 8; "
        "make the sizes multiply to 8 (or use -1 on one axis)"
    )
    assert not (tmp_path / "r").exists()


def test_overrides_may_come_before_and_after_flags():
    from jaxdist import train

    args = train.parse_args(["model.num_layers=2", "--steps", "3", "optim.lr=1e-3", "--mesh", "dp=2,fsdp=4"])
    assert args.overrides == ["model.num_layers=2", "optim.lr=1e-3"] and args.steps == 3
    cfg = train.resolve_config(args)
    assert (cfg.model.num_layers, cfg.train.steps, cfg.optim.lr, cfg.mesh.shape) == (2, 3, 1e-3, "dp=2,fsdp=4")


def test_the_same_command_resumes_after_sigterm_in_the_default_run_dir(tmp_path, capsys, monkeypatch):
    """No --run-dir: the run dir is named by the config, so after SIGTERM the same command (same folder,
    same arguments) resumes from the saved step instead of starting a new run at step 0. Every run is
    `train.main` in this process, in the same working directory; the first gets a real SIGTERM (os.kill
    of this process, through the handler main installs) the moment it prints its step-2 checkpoint line."""
    import re
    import signal
    import sysconfig

    from conftest import MICRO_MODEL, NO_PLOT, SignalOnLine

    from jaxdist import train

    cmd = [
        sys.executable,
        "-u",
        "-m",
        "jaxdist.train",
        "--steps",
        "6",
        *[f"model.{k}={v}" for k, v in MICRO_MODEL.items()],
        "optim.warmup_steps=1",
        "train.eval_every=0",
        "train.log_every=1",
        "checkpoint.every=2",
        "train.trackers=[]",
        NO_PLOT,
        f"data.path={sysconfig.get_paths()['stdlib']}/[a-c]*.py",  # 29 files: quicker to read than all 1,790
    ]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TQDM_DISABLE", "1")

    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(sys, "stdout", SignalOnLine(sys.stdout, lambda text: "checkpoint step 2" in text, signal.SIGTERM))
        code = train.main(cmd[4:])  # after `python -u -m jaxdist.train`
    text = capsys.readouterr().out
    assert code == 0, text
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"tiny-[0-9a-f]{8}", run_dir.name), run_dir.name
    assert (
        f"run dir {Path('runs') / run_dir.name} (named by this config, train.steps aside: the same command "
        "resumes it, a larger --steps extends it): new run, starting at step 0" in text
    ), text
    m = re.search(
        r"stopped by SIGTERM at step (\d+); latest checkpoint: step (\d+) .*run the same command to resume", text
    )
    assert m and m.group(1) == m.group(2), text
    stopped = int(m.group(1))
    assert 2 <= stopped < 6

    assert "no loss plot (train.plot=false)" in text and not (run_dir / "loss.png").exists()

    def again(argv):  # the same command, in this process: (exit code, stdout)
        capsys.readouterr()
        code = train.main(argv[4:])  # after `python -u -m jaxdist.train`
        return code, capsys.readouterr().out

    code, second = again(cmd)
    assert code == 0, second
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]  # no second folder
    assert f": resuming from step {stopped} ({Path('runs') / run_dir.name / 'checkpoints' / str(stopped)})" in (
        second
    ), second
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "step" in r]
    assert steps[-1] == 6 and second.strip().splitlines()[-1].startswith("done: 6 steps")
    # The smoothed loss goes on through the resume: the bias-corrected EMA of every logged raw loss.
    by_step = {r["step"]: r for r in records if "step" in r}
    assert sorted(by_step) == list(range(1, 7))
    ema = 0.0
    for s in range(1, 7):
        ema = 0.9 * ema + 0.1 * by_step[s]["loss"]
        assert by_step[s]["loss_smooth"] == pytest.approx(ema / (1 - 0.9**s), rel=1e-9), s
    # The rule's other half: a larger --steps is the same run, extended in the same folder.
    longer = [x if x != "6" else "7" for x in cmd]
    code, third = again(longer)
    assert code == 0 and [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]
    assert ": resuming from step 6 (" in third and "done: 7 steps" in third, third
    # Finished: the same command (another mesh too: the mesh is not part of the run's name) has nothing to do.
    code, fourth = again([*longer, "--mesh", "dp=8"])
    assert code == 0 and [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]
    assert "nothing to do: " in fourth and "is already at step 7 of train.steps=7 (raise --steps" in fourth, fourth
    # A step's log line comes before that step's checkpoint message.
    for out in (text, second):
        for m in re.finditer(r"^checkpoint step (\d+): writing", out, re.M):
            assert f"step {m.group(1)}/6 | " in out[: m.start()], out

"""Per-step bookkeeping of the training loop: metrics read one step late, throughput per log interval,
the non-finite streak, a smoothed loss, metrics.jsonl records, what the person watching sees (a tqdm bar
on a terminal, one plain line per log interval otherwise) and the final summary.

Reading step s's metrics after step s+1 was dispatched keeps the device busy while the host waits:
the wait ends when step s is done, so the time between two reads is one step's time. Evaluation time is
kept out of the throughput.

A read is a clock point only if the host really waited: metrics already computed when the host came
for them (it was busy elsewhere, e.g. saving a checkpoint, which waits for the state) finished at some
unknown earlier time, and timing the next step from "now" would shorten it, up to MFUs of thousands of
percent after a resume. So the clock restarts only after a real wait, and an interval is then an upper
bound of its steps' time (MFU a lower bound). MFU is also capped at 100%, with one line saying so, for
a peak set too low (train.peak_flops).

Throughput is achieved model FLOP/s (`flops_per_sec`, every record), and MFU (`mfu`) only where there is
a peak to divide by: a datasheet peak or train.peak_flops. A CPU has no datasheet peak, and a probed one
moved with the machine's load (the same run read ~17% or ~31%), so CPU runs report FLOP/s alone.

The smoothed loss is an exponential moving average with Adam's bias correction (the first value is the
first loss, not 10% of it), and its state (`carry()`) is saved with each checkpoint so a resumed run
continues the same curve.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from typing import Any, cast

import jax
from tqdm import tqdm

from jaxdist.data.run_tokenizer import byte_tokens
from jaxdist.errors import JaxdistError

STEP_KEYS = ("loss", "lr", "grad_norm", "skipped")
SMOOTHING = 0.9  # EMA of the train loss (bias-corrected): ~10 steps; one 8x128 batch is noisy


def plain_output(stream=None) -> bool:
    """Plain log lines instead of a progress bar: stdout is not a terminal (SLURM, nohup, CI, a pipe), or
    the user set TQDM_DISABLE. (stdout is looked up now: a default bound at import kept a closed stream.)"""
    stream = stream or sys.stdout
    disabled = os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no")
    return disabled or not stream.isatty()


def loss_text(loss: float | None, byte_tokens: bool) -> str:
    """A loss with its unit: nats per token, and bits per byte when a token is a byte."""
    if loss is None or not math.isfinite(loss):
        return f"{loss}"
    return f"{loss:.4f} nats/token" + (f" ({loss / math.log(2):.3f} bits/byte)" if byte_tokens else "")


def task_text(record: dict) -> str:
    """data.sources' held-out losses and train.eval_tasks' scores for a log line: ', web 3.21, code 2.87,
    jx_choice acc 0.75, ...' ('' with neither)."""
    shown = [f"{k.split('/', 1)[1]} {v:.4f}" for k, v in record.items() if k.startswith(("loss/", "eval_loss/"))]
    shown += [
        f"{k[5:].replace('/', ' ')} {v:.4g}"
        for k, v in record.items()
        if k.startswith("eval/") and "sample_len" not in k
    ]
    return "".join(f", {t}" for t in shown)


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    def __init__(
        self,
        cfg,
        writer,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: float | None,
        skipped_in_a_row: int = 0,
        start: int = 0,
        enabled: bool = True,
        memory=None,
        log=print,
        carry: dict | None = None,
    ):
        """`memory() -> dict | None`: the device allocator's figures, logged with every record.
        `log`: where messages and plain lines go (above the bar when there is one). `carry`: the smoothed
        loss's state saved with the checkpoint this run resumes from (`carry()`)."""
        self.cfg, self.writer, self.enabled, self.log = cfg, writer, enabled, log
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak_flops
        self.memory = memory or (lambda: None)
        self.byte_tokens = byte_tokens(cfg)
        self.plain = plain_output()
        self.bar = tqdm(
            total=cfg.train.steps, initial=start, disable=not enabled or self.plain, dynamic_ncols=True, mininterval=1.0
        )
        self.in_a_row = skipped_in_a_row  # carried across a resume by the checkpointed state
        self.skipped_total, self.skipped_at = 0, []
        self.last_loss, self.eval_loss = math.nan, None
        self.ema, self.ema_steps = 0.0, 0
        if carry:
            self.ema, self.ema_steps = float(carry["loss_ema"]), int(carry["loss_ema_steps"])
        self.rates: list[float] = []
        self.step_time = None
        self.capped = False
        self.restart_clock()

    def say(self, message: str) -> None:
        """A message that does not break the progress bar (process 0 only)."""
        if self.enabled:
            tqdm.write(message) if not self.bar.disable else self.log(message)
            sys.stdout.flush()  # a log file (SLURM, nohup) sees each line when it is written

    def restart_clock(self) -> None:
        """Throughput counts from here (after compilation, after an evaluation)."""
        self.clock, self.steps_on_clock = time.perf_counter(), 0

    def mfu(self, tokens_per_sec: float) -> float:
        raw = tokens_per_sec * self.flops_per_token / self.peak if self.peak else 0.0
        if raw > 1 and not self.capped:
            self.capped = True
            self.say(
                f"note: measured {tokens_per_sec * self.flops_per_token:.3g} FLOP/s exceeds the peak estimate "
                f"{self.peak:.3g}; MFU is shown as at most 100% (set train.peak_flops to the true peak)"
            )
        return min(raw, 1.0)

    def carry(self) -> dict:
        """What a checkpoint keeps so a resume continues the smoothed loss (JSON)."""
        return {"loss_ema": self.ema, "loss_ema_steps": self.ema_steps}

    def throughput(self, tokens_per_sec: float) -> dict:
        """Achieved model FLOP/s, and MFU where there is a peak."""
        out = {"flops_per_sec": tokens_per_sec * self.flops_per_token}
        if self.peak:
            out["mfu"] = self.mfu(tokens_per_sec)
        return out

    def throughput_text(self, record: dict) -> str:
        if "mfu" in record:
            return f"MFU {record['mfu']:.1%}"
        return f"{record['flops_per_sec'] / 1e9:.3g} GFLOP/s"

    @property
    def smoothed(self) -> float:
        return self.ema / (1 - SMOOTHING**self.ema_steps) if self.ema_steps else math.nan

    def _account(self, done: int, vals: dict) -> None:
        if vals["skipped"]:
            self.skipped_total += 1
            self.skipped_at.append(done)
            self.in_a_row += 1
            if self.in_a_row >= self.cfg.train.max_skipped_steps:
                raise JaxdistError(
                    f"{self.in_a_row} consecutive steps had non-finite loss or gradients (last at step {done}); "
                    "lower optim.lr or check the data — the last good checkpoint is kept"
                )
        else:
            self.in_a_row, self.last_loss = 0, vals["loss"]
            self.ema = SMOOTHING * self.ema + (1 - SMOOTHING) * vals["loss"]
            self.ema_steps += 1

    def record(self, step: int, metrics: dict, evaluate=None, final: bool = False) -> None:
        """Account for optimizer step `step` (0-based) whose metrics are `metrics`; waits for it.
        `evaluate() -> {"eval_loss": ..., and train.eval_tasks' "eval/TASK/METRIC": ...}` runs after the
        throughput is taken, so its time does not count."""
        waited = not all(getattr(v, "is_ready", lambda: True)() for v in metrics.values())
        vals = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self.steps_on_clock += 1
        done = step + 1
        self._account(done, vals)
        self.bar.update(1)  # before an evaluation's line: the bar shows step `done` when "eval at step done" prints

        record = {}
        if done % self.cfg.train.log_every == 0 or final or evaluate is not None:
            self.step_time = (time.perf_counter() - self.clock) / self.steps_on_clock
            tps = self.tokens_per_step / self.step_time
            self.rates.append(tps)
            record = {
                "loss": vals["loss"],
                "loss_smooth": self.smoothed,
                "lr": vals["lr"],
                "grad_norm": vals["grad_norm"],
                "tokens_per_sec": tps,
                "step_time_s": self.step_time,
                **self.throughput(tps),
                "skipped_steps": self.skipped_total,
                **({"skipped_at": self.skipped_at} if self.skipped_at else {}),
                **(self.memory() or {}),
                **{k: v for k, v in vals.items() if k not in STEP_KEYS},
            }
            self.skipped_at = []
            postfix: dict[str, Any] = {  # as keywords: tqdm shows them sorted by name
                "loss": f"{vals['loss']:.3f}",
                "smooth": f"{self.smoothed:.3f}",
                "tok_s": f"{tps:,.0f}",
                **({"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}),
                **({} if "mfu" in record else {"gflop_s": f"{record['flops_per_sec'] / 1e9:.3g}"}),
            }
            self.bar.set_postfix(**postfix)
            if waited:  # else "now" is later than this step's end: keep timing from the last real wait
                self.restart_clock()
        if evaluate is not None:
            result = evaluate()  # the eval loss, or a dict of it ("loss"), an objective's statistics and
            got = result if isinstance(result, dict) else {}  # train.eval_tasks' "eval/TASK/METRIC" numbers
            record.update({k if k.startswith("eval/") else f"eval_{k}": v for k, v in got.items() if k != "loss"})
            self.restart_clock()
            if got and "loss" not in got:  # GRPO: held-out rewards, no loss
                if not self.plain:
                    self.say(f"eval at step {done}: " + ", ".join(f"{k} {v:.4g}" for k, v in got.items()))
            else:
                # a dict's "loss", else the plain eval loss itself
                self.eval_loss = record["eval_loss"] = got["loss"] if got else cast(float, result)
                if not self.plain:
                    self.say(f"eval at step {done}: loss {loss_text(self.eval_loss, self.byte_tokens)}{task_text(got)}")
        if record:
            self.writer.write({"step": done, **record})
            if self.plain:
                self.say(self.line(done, record))

    def line(self, done: int, record: dict) -> str:
        """One plain log line: step, loss (raw and smoothed, with units), eval loss, tokens/s, MFU, ETA."""
        total = self.cfg.train.steps
        parts = [
            f"step {done}/{total}",
            f"loss {loss_text(record['loss'], self.byte_tokens)}",
            f"smoothed {record['loss_smooth']:.4f}",
        ]
        if "eval_loss" in record:
            parts.append(f"eval loss {loss_text(record['eval_loss'], self.byte_tokens)}{task_text(record)}")
        if "reward" in record:  # GRPO: the batch's mean reward, and the held-out prompts' at an evaluation
            held = f" (eval {record['eval_reward']:.4g})" if "eval_reward" in record else ""
            parts.append(f"reward {record['reward']:.4g}{held}")
        parts += [
            f"lr {record['lr']:.3g}",
            f"{record['tokens_per_sec']:,.0f} tok/s",
            self.throughput_text(record),
        ]
        if "memory_in_use" in record:
            parts.append(
                f"device memory {record['memory_in_use'] / 2**30:.2f} GiB "
                f"(peak {record.get('memory_peak', 0) / 2**30:.2f})"
            )
        if record.get("skipped_at"):
            parts.append(f"skipped steps {record['skipped_at']}")
        parts.append(f"ETA {duration((total - done) * self.step_time)}" if done < total else "done")
        return " | ".join(parts)

    def close(self) -> None:
        self.bar.close()

    def summary(self, steps_done: int, compile_s: float) -> dict:
        # The first interval after a (re)start can include one-off work; the median ignores it.
        tps = statistics.median(self.rates) if self.rates else 0.0
        return {
            "summary": True,
            "steps": steps_done,
            "final_loss": self.last_loss,
            "final_loss_smooth": self.smoothed,
            "eval_loss": self.eval_loss,
            "tokens_per_sec": tps,
            **self.throughput(tps),
            "compile_s": compile_s,
            "skipped_steps": self.skipped_total,
            **(self.memory() or {}),
        }

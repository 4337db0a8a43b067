"""Per-step bookkeeping of the training loop: metrics read one step late, throughput per log interval,
the non-finite streak, metrics.jsonl records, the progress bar and the final summary.

Reading step s's metrics after step s+1 was dispatched keeps the device busy while the host waits:
the wait ends when step s is done, so the time between two reads is one step's time. Evaluation time is
kept out of the throughput.

A read is a clock point only if the host really waited: metrics already computed when the host came
for them (it was busy elsewhere, e.g. saving a checkpoint, which waits for the state) finished at some
unknown earlier time, and timing the next step from "now" would shorten it, up to MFUs of thousands of
percent after a resume. So the clock restarts only after a real wait, and an interval is then an upper
bound of its steps' time (MFU a lower bound). MFU is also capped at 100%, with one line saying so, for
a peak that was measured low (the CPU matmul probe on a busy machine).
"""

from __future__ import annotations

import math
import statistics
import time

import jax

from jaxdist.errors import JaxdistError

STEP_KEYS = ("loss", "lr", "grad_norm", "skipped")


class Progress:
    def __init__(self, cfg, writer, bar, tokens_per_step: int, flops_per_token: float, peak_flops: float,
                 skipped_in_a_row: int = 0):
        self.cfg, self.writer, self.bar = cfg, writer, bar
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak_flops
        self.in_a_row = skipped_in_a_row  # carried across a resume by the checkpointed state
        self.skipped_total, self.last_loss, self.eval_loss = 0, math.nan, None
        self.rates: list[float] = []
        self.capped = False
        self.restart_clock()

    def restart_clock(self) -> None:
        """Throughput counts from here (after compilation, after an evaluation)."""
        self.clock, self.steps_on_clock = time.perf_counter(), 0

    def mfu(self, tokens_per_sec: float) -> float:
        raw = tokens_per_sec * self.flops_per_token / self.peak if self.peak else 0.0
        if raw > 1 and not self.capped:
            self.capped = True
            if jax.process_index() == 0:
                print(f"note: measured {tokens_per_sec * self.flops_per_token:.3g} FLOP/s exceeds the peak estimate "
                      f"{self.peak:.3g}; MFU is shown as at most 100% (set train.peak_flops to the true peak)")
        return min(raw, 1.0)

    def record(self, step: int, metrics: dict, evaluate=None, final: bool = False) -> None:
        """Account for optimizer step `step` (0-based) whose metrics are `metrics`; waits for it.
        `evaluate() -> eval loss` runs after the throughput is taken, so its time does not count."""
        waited = not all(getattr(v, "is_ready", lambda: True)() for v in metrics.values())
        vals = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self.steps_on_clock += 1
        done = step + 1
        if vals["skipped"]:
            self.skipped_total += 1
            self.in_a_row += 1
            if self.in_a_row >= self.cfg.train.max_skipped_steps:
                raise JaxdistError(
                    f"{self.in_a_row} consecutive steps had non-finite loss or gradients (last at step {done}); "
                    "lower optim.lr or check the data — the last good checkpoint is kept")
        else:
            self.in_a_row, self.last_loss = 0, vals["loss"]

        record = {}
        if done % self.cfg.train.log_every == 0 or final or evaluate is not None:
            step_time = (time.perf_counter() - self.clock) / self.steps_on_clock
            tps = self.tokens_per_step / step_time
            self.rates.append(tps)
            record = {"loss": vals["loss"], "lr": vals["lr"], "grad_norm": vals["grad_norm"],
                      "tokens_per_sec": tps, "step_time_s": step_time, "mfu": self.mfu(tps),
                      "skipped_steps": self.skipped_total,
                      **{k: v for k, v in vals.items() if k not in STEP_KEYS}}
            self.bar.set_postfix(loss=f"{vals['loss']:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{record['mfu']:.1%}")
            if waited:  # else "now" is later than this step's end: keep timing from the last real wait
                self.restart_clock()
        if evaluate is not None:
            self.eval_loss = record["eval_loss"] = evaluate()
            self.restart_clock()
        if record:
            self.writer.write({"step": done, **record})
        self.bar.update(1)

    def summary(self, steps_done: int, compile_s: float) -> dict:
        # The first interval after a (re)start can include one-off work; the median ignores it.
        tps = statistics.median(self.rates) if self.rates else 0.0
        return {"summary": True, "steps": steps_done, "final_loss": self.last_loss, "eval_loss": self.eval_loss,
                "tokens_per_sec": tps, "mfu": self.mfu(tps), "compile_s": compile_s,
                "skipped_steps": self.skipped_total}

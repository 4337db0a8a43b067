"""One training run as one object: `Run` owns the run's state (its fields: `RunState`, jaxdist/training/state.py
— config, mesh, program, data, saver, writers, progress, stopper) and its phases are its methods, called in
order by `Run.train()`.

    set_up         every check on input; the config on the mesh, the program, the data (startup.py)
    restore_state  where it starts from: its own checkpoint, another run's, a Hugging Face model (resume.py)
    open           the lock, the records, the start-up lines, the metrics writer, the saver (opening.py)
    compile        the first state and batch, the compiled step (stepping.py), then the progress bar
    loop           the step loop and its hooks, the loss plot (stepping.py)
    finish         the summary line and the closing lines -> RunResult (finish.py)

Nothing is written before `open`; a phase that ends the run early returns its `RunResult`.
"""

from __future__ import annotations

from jaxdist.training import finish, opening, resume, startup, stepping
from jaxdist.training.state import RunResult, RunState


class Run(RunState):
    """A training run: its state (`RunState`'s fields) and its phases."""

    def train(self) -> RunResult:
        """Set up, restore, (start writing), compile, run, finish: what the trainer does, in that order."""
        self.set_up()
        self.restore_state()
        if (early := finish.before_writing(self)) is not None:
            return early
        self.open()  # input is valid: from here on we write
        self.compile()
        if (stopped := finish.stopped_before_training(self.stopper, self.run_dir, self.log)) is not None:
            self.saver.close()
            return stopped
        self.loop()
        return self.finish()

    def set_up(self) -> None:
        """Every check on input, then the config on the mesh, the program, the data, the task evaluator."""
        startup.set_up(self)

    def restore_state(self) -> None:
        """Where the run starts from (nothing written yet)."""
        resume.start_from(self)

    def open(self) -> None:
        """The lock, the records and start-up lines, the metrics writer, what restoring leaves, the saver."""
        opening.start_writing(self)
        if self.restored is not None:
            resume.after_restore(self)
        self.saver = opening.saver(self)

    def compile(self) -> None:
        """The first state and batch, the compiled step; then the progress bar (it reads the state)."""
        stepping.compile_step(self)
        self.eval_arrays = self.loader.eval_arrays()
        opening.progress(self)

    def loop(self) -> None:
        """The step loop with its hooks; the loss plot however it ends."""
        stepping.train(self)

    def finish(self) -> RunResult:
        return finish.finish(self)
